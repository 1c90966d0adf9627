"""A split without a sample is refused at ``--dry-run`` and at launch, never built.

Reproduction of the hang (PLATFORM.md, "Measured 11-27"): a plain text file preprocessed
without ``--split-lines`` is one document; the ``text_corpus`` recipe's ``98,2,0`` split
then gives validation no document, and megatron-core's ``GPTDataset._get_num_epochs``
loops forever.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bridge.config import ConfigError, load_config
from bridge.train.cli import EXIT_CONFIG_ERROR, main
from bridge.train.data.datasets import (
    build_train_valid_test_datasets,
    train_valid_test_num_samples,
)
from bridge.train.data.preprocess import preprocess_data
from bridge.train.data.tokenizers import ByteLevelTokenizer
from bridge.train.recipes import recipe_path

_WORDS = ["the", "cat", "sat", "on", "the", "mat", "while", "a", "dog", "ran", "by"]


def _corpus(tmp_path: Path, name: str, lines: list[str], split_lines: bool) -> str:
    text = tmp_path / f"{name}.txt"
    text.write_text("\n".join(lines) + "\n")
    prefix = str(tmp_path / name)
    preprocess_data([text], prefix, ByteLevelTokenizer(), split_lines=split_lines)
    return prefix


def _one_document(tmp_path: Path) -> str:
    lines = [" ".join(_WORDS[(i + j) % len(_WORDS)] for j in range(12)) for i in range(200)]
    return _corpus(tmp_path, "one_document", lines, split_lines=False)


def _refusal(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("bridge-train: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_dry_run_refuses_a_split_without_documents(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blend = f"dataset.blend=[[{_one_document(tmp_path)}],null]"
    line = _refusal(capsys, ["--recipe", "text_corpus", blend, "--dry-run"])
    assert line.startswith("bridge-train: error: dataset.split: the validation split of "), line
    assert "gets no document (1 document in all, split '98,2,0')" in line
    assert "--split-lines" in line and "dataset.split=100,0,0 train.eval_iters=0" in line
    # The fix the message gives is a valid launch.
    assert main_code(["--recipe", "text_corpus", blend, "--dry-run", *_FIX]) == 0


_FIX = ["dataset.split=100,0,0", "train.eval_iters=0"]


def main_code(argv: list[str]) -> int:
    try:
        main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def test_a_split_shorter_than_one_sample_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 60 short lines as documents: 2% validation is one line of 20-odd bytes, while a
    # sample of the recipe needs 129 tokens.
    lines = [" ".join(_WORDS[(i + j) % len(_WORDS)] for j in range(4)) for i in range(60)]
    prefix = _corpus(tmp_path, "short_lines", lines, split_lines=True)
    line = _refusal(
        capsys, ["--recipe", "text_corpus", f"dataset.blend=[[{prefix}],null]", "--dry-run"]
    )
    assert "the validation split of" in line and "holds 1 document of" in line, line
    assert "fewer than one sample (129 tokens: sequence length 128 + 1)" in line


@pytest.mark.timeout(120)  # today's main spins in GPTDataset._get_num_epochs: the timeout fails
def test_building_the_datasets_refuses_it_instead_of_hanging(tmp_path: Path) -> None:
    # The launch path below the command (pretrain's setup, or a script calling it directly).
    prefix = _one_document(tmp_path)
    cfg = load_config(
        recipe_path("text_corpus"),
        [f"dataset.blend=[[{prefix}],null]", f"dataset.path_to_cache={tmp_path / 'cache'}"],
    )
    cfg.validate(world_size=1)
    assert cfg.train is not None and cfg.dataset is not None
    with pytest.raises(ConfigError, match=r"the validation split of .* gets no document"):
        build_train_valid_test_datasets(
            cfg.dataset, ByteLevelTokenizer(), train_valid_test_num_samples(cfg.train)
        )
