"""Values validate() fills in: in memory as before, saved as unset, derived again later."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

import bridge.config as bc
from bridge.config import ConfigContainer, ConfigError, apply_overrides, load_config
from bridge.config.testing import ExampleCommOverlapConfig, ExampleModelConfig, tiny_container


def test_filled_values_are_in_memory_but_saved_unset(tmp_path: Path) -> None:
    cfg = tiny_container(comm_overlap=ExampleCommOverlapConfig())
    cfg.validate(world_size=2)
    assert cfg.train is not None and cfg.scheduler is not None
    # What the trainer reads after validate() is there, as before.
    assert cfg.train.global_batch_size == 4 and cfg.data_parallel_size == 2
    assert (cfg.scheduler.lr_decay_iters, cfg.scheduler.lr_decay_steps) == (10, 40)
    assert cfg.comm_overlap is not None and cfg.comm_overlap.data_parallel_size == 2

    path = tmp_path / "run.yaml"
    cfg.to_yaml(path)
    saved = yaml.safe_load(path.read_text())
    assert saved["train"]["global_batch_size"] is None
    assert saved["scheduler"]["lr_decay_iters"] is None
    assert saved["scheduler"]["lr_decay_steps"] is None
    assert saved["data_parallel_size"] is None
    assert saved["comm_overlap"]["data_parallel_size"] is None
    assert saved["train"]["train_iters"] == 10  # values the user set are saved
    assert cfg.to_dict() == saved

    printed = yaml.safe_load(cfg.format_yaml())  # printing shows the effective values
    assert printed["train"]["global_batch_size"] == 4
    assert printed["scheduler"]["lr_decay_iters"] == 10
    assert printed["data_parallel_size"] == 2
    # A diff lists what the user changed, not what validate() derived.
    paths = {d.path for d in cfg.diff_from_defaults()}
    assert "train.train_iters" in paths
    assert not paths & {"train.global_batch_size", "scheduler.lr_decay_iters"}


def test_saved_run_loaded_with_a_longer_run_gets_a_matching_schedule(tmp_path: Path) -> None:
    cfg = tiny_container()
    cfg.validate(world_size=1)
    assert cfg.scheduler is not None and cfg.scheduler.lr_decay_iters == 10
    path = tmp_path / "run.yaml"
    cfg.to_yaml(path)

    longer = load_config(path, ["train.train_iters=100"])
    longer.validate(world_size=1)
    assert longer.scheduler is not None and longer.train is not None
    assert longer.scheduler.lr_decay_iters == 100
    assert longer.train.global_batch_size == 2
    assert longer.scheduler.lr_decay_steps == 100 * 2

    # The same through apply_overrides on the validated container in memory.
    changed = apply_overrides(cfg, ["train.train_iters=100"])
    assert changed.scheduler is not None and changed.scheduler.lr_decay_iters is None
    changed.validate(world_size=1)
    assert changed.scheduler.lr_decay_iters == 100
    assert cfg.scheduler.lr_decay_iters == 10  # the input is unchanged


def test_validate_at_another_world_size_derives_again(tmp_path: Path) -> None:
    cfg = tiny_container()
    cfg.validate(world_size=2)
    assert cfg.train is not None and cfg.scheduler is not None
    assert (cfg.train.global_batch_size, cfg.scheduler.lr_decay_steps) == (4, 40)
    cfg.validate(world_size=4)
    assert (cfg.data_parallel_size, cfg.train.global_batch_size) == (4, 8)
    assert cfg.scheduler.lr_decay_steps == 80 and cfg.scheduler.lr_warmup_steps == 16
    cfg.validate(world_size=2)
    assert cfg.train.global_batch_size == 4

    # A run saved at world size 2 validates at world size 4.
    path = tmp_path / "run.yaml"
    cfg.to_yaml(path)
    loaded = ConfigContainer.from_yaml(path)
    loaded.validate(world_size=4)
    assert loaded.train is not None and loaded.train.global_batch_size == 8


def test_explicit_global_batch_size_is_kept_and_checked() -> None:
    cfg = tiny_container(
        train=bc.TrainingConfig(micro_batch_size=2, global_batch_size=8, train_iters=10)
    )
    cfg.validate(world_size=2)
    cfg.validate(world_size=4)
    assert cfg.train is not None and cfg.train.global_batch_size == 8
    assert cfg.to_dict()["train"]["global_batch_size"] == 8
    with pytest.raises(
        ConfigError, match=r"^train.global_batch_size: got 8; it must be at least .* = 16$"
    ):
        cfg.validate(world_size=8)


def test_assigning_a_filled_field_makes_it_the_users() -> None:
    cfg = tiny_container()
    cfg.validate(world_size=2)
    assert cfg.train is not None and cfg.scheduler is not None
    # The same value the fill-in had: still an explicit choice from now on.
    cfg.train.global_batch_size = 4
    cfg.scheduler.lr_decay_iters = 10
    assert cfg.to_dict()["train"]["global_batch_size"] == 4
    assert cfg.to_dict()["scheduler"]["lr_decay_iters"] == 10
    with pytest.raises(ConfigError, match=r"^train.global_batch_size: got 4; it must be at least"):
        cfg.validate(world_size=4)

    # Set through an override, it is the user's too.
    validated = tiny_container()
    validated.validate(world_size=2)
    pinned = apply_overrides(validated, ["train.global_batch_size=4", "train.train_iters=20"])
    with pytest.raises(ConfigError, match=r"train.global_batch_size: got 4"):
        pinned.validate(world_size=4)
    pinned.validate(world_size=2)
    assert pinned.scheduler is not None and pinned.scheduler.lr_decay_iters == 20


def test_a_failed_validate_keeps_the_last_derived_values() -> None:
    cfg = tiny_container(model=ExampleModelConfig(tensor_model_parallel_size=2))
    cfg.validate(world_size=2)
    assert cfg.train is not None and cfg.train.global_batch_size == 2
    with pytest.raises(ConfigError, match="world size 3 is not divisible"):
        cfg.validate(world_size=3)
    assert cfg.train.global_batch_size == 2 and cfg.data_parallel_size == 1
    assert cfg.to_dict()["train"]["global_batch_size"] is None  # still derived, not the user's


def test_copies_carry_the_marks_independently() -> None:
    cfg = tiny_container()
    cfg.validate(world_size=2)
    shallow = copy.copy(cfg)  # as a trainer does before saving without runtime hooks
    deep = copy.deepcopy(cfg)
    assert shallow.to_dict() == deep.to_dict() == cfg.to_dict()
    assert deep.train is not None and cfg.train is not None
    deep.train.global_batch_size = 16
    assert deep.to_dict()["train"]["global_batch_size"] == 16
    assert cfg.to_dict()["train"]["global_batch_size"] is None


def test_sample_based_fill_ins_follow_train_samples(tmp_path: Path) -> None:
    cfg = tiny_container(
        train=bc.TrainingConfig(micro_batch_size=2, train_samples=800),
        scheduler=bc.SchedulerConfig(lr_warmup_samples=80),
    )
    cfg.validate(world_size=1)
    assert cfg.scheduler is not None and cfg.scheduler.lr_decay_samples == 800
    path = tmp_path / "run.yaml"
    cfg.to_yaml(path)
    more = load_config(path, ["train.train_samples=1600"])
    more.validate(world_size=1)
    assert more.scheduler is not None
    assert (more.scheduler.lr_decay_samples, more.scheduler.lr_decay_steps) == (1600, 1600)
