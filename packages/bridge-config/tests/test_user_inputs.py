"""Inputs a new user writes that were taken at face value: ``None`` for a path, an alias bomb,
a dataset class swapped by one field override."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import bridge.config as bc
from bridge.config import ConfigError, load_config


def test_a_bare_none_is_refused_with_the_null_hint(recipe: Path) -> None:
    # Without the check, checkpoint.save=None saved into a directory named "None".
    with pytest.raises(ConfigError, match=r"checkpoint\.save: got 'None', a string") as info:
        load_config(recipe, ["checkpoint.save=None"])
    assert "write null" in str(info.value) and "section.field=null" in str(info.value)
    cfg = load_config(recipe, ["checkpoint.save=null"])
    assert cfg.checkpoint is not None and cfg.checkpoint.save is None
    cfg = load_config(recipe, ["checkpoint.save=runs/None"])  # a path that merely contains it
    assert cfg.checkpoint is not None and cfg.checkpoint.save == "runs/None"


def test_a_bare_none_in_yaml_is_refused(write_yaml: Callable[..., Path], recipe: Path) -> None:
    text = recipe.read_text().replace("\n  save: null\n", "\n  save: None\n", 1)
    with pytest.raises(ConfigError, match=r"checkpoint\.save: got 'None', a string"):
        load_config(write_yaml(text, "none.yaml"))


_LAUGHS = "\n".join(
    [
        'a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]',
        *(
            f"{name}: &{name} [{', '.join([f'*{prev}'] * 10)}]"
            for prev, name in zip("abcdefgh", "bcdefghi", strict=True)
        ),
        "train:",
        "  micro_batch_size: *i",
    ]
)


@pytest.mark.timeout(60)  # without the check this walks 10**9 values: the timeout fails it
def test_yaml_aliases_that_expand_exponentially_are_refused(
    write_yaml: Callable[..., Path], recipe: Path
) -> None:
    with pytest.raises(ConfigError, match=r"aliases expand to more than 1,000,000 values"):
        load_config(write_yaml(_LAUGHS, "laughs.yaml"))
    with pytest.raises(ConfigError, match="refers to itself"):
        load_config(write_yaml("a: &a [1, *a]\n", "recursive.yaml"))
    # Ordinary anchors and merges stay fine.
    ordinary = (
        recipe.read_text()
        .replace("\n  save: null\n", "\n  save: &dir runs/a\n", 1)
        .replace("\n  load: null\n", "\n  load: *dir\n", 1)
    )
    cfg = load_config(write_yaml(ordinary, "ordinary.yaml"))
    assert cfg.checkpoint is not None and cfg.checkpoint.load == cfg.checkpoint.save == "runs/a"


def test_a_target_override_drops_the_old_class_fields(recipe: Path) -> None:
    # The file has a (mock) GPT dataset with blend, split, random_seed, ...; the overrides
    # swap in SFT data by fields alone, no whole dataset={_target_: ...} mapping needed.
    before = load_config(recipe).dataset
    assert before is not None and not isinstance(before, bc.FinetuningDatasetConfig)
    swap = "dataset._target_=bridge.config.FinetuningDatasetConfig"
    swapped = load_config(recipe, [swap, "dataset.dataset_root=data/sft"])
    assert isinstance(swapped.dataset, bc.FinetuningDatasetConfig)
    assert str(swapped.dataset.dataset_root) == "data/sft"
    # Fields both classes have keep the file's values (the recipe's num_workers: 0).
    assert swapped.dataset.num_workers == before.num_workers == 0
    # A field the user gives that the new class lacks is still refused.
    with pytest.raises(ConfigError, match=r"dataset\.split: unknown field"):
        load_config(recipe, [swap, "dataset.split=1,0,0"])
