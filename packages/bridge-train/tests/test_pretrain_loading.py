"""Which checkpoint ``pretrain`` loads, decided end to end (one forked gloo rank per launch).

The checkpoint section's options are exercised through ``pretrain`` itself, not only through
``load_checkpoint``: an empty ``checkpoint.load`` falls back to ``pretrained_checkpoint``; a
save directory that holds only non-persistent checkpoints (a run killed before its first
persistent save) is resumed from them; ``ckpt_step`` loads a complete ``iter_*`` directory
of a load directory without a tracker.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

from bridge.config import CheckpointConfig, LoggerConfig
from bridge.train import forward_step, pretrain
from bridge.train.metrics import read_metrics_file
from bridge.train.testing import tiny_config_container, tiny_train_config
from core_utils.testing import DistributedTestError, run_distributed

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


class _LoadMessages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _launch(rank: int, world: int, metrics: str, kill_at: Any, sections: dict) -> list[str]:
    """One ``pretrain`` run; returns what the checkpoint loader logged."""
    handler = _LoadMessages()
    loader_logger = logging.getLogger("bridge.train.checkpointing.load")
    loader_logger.addHandler(handler)
    loader_logger.setLevel(logging.INFO)

    def step(state: Any, data_iterator: Any, model: Any) -> Any:
        if kill_at is not None and state.train_state.step == kill_at - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return forward_step(state, data_iterator, model)

    cfg = tiny_config_container(
        logger=LoggerConfig(log_interval=1),
        **sections,
    )
    assert pretrain(cfg, step, metrics_file=metrics) == 0
    return handler.messages


def _launch_command(rank: int, world: int, metrics: str, save: str) -> tuple[list[str], int]:
    """``bridge-train`` resuming ``save`` for 4 iterations; returns what the checkpoint
    code logged and how often the tracker lookup itself ran."""
    from bridge.train.checkpointing import layout
    from bridge.train.cli import run

    handler = _LoadMessages()
    checkpoint_logger = logging.getLogger("bridge.train.checkpointing")
    checkpoint_logger.addHandler(handler)
    checkpoint_logger.setLevel(logging.INFO)
    lookups = [0]
    look = layout._find_latest

    def spy(base: Path, step: int | None) -> Any:
        lookups[0] += 1
        return look(base, step)

    layout._find_latest = spy
    config = Path(metrics).with_suffix(".yaml")
    tiny_config_container(
        train=tiny_train_config(train_iters=4),
        checkpoint=CheckpointConfig(save=save, save_interval=2),
    ).to_yaml(config)
    assert run(["--config", str(config), "--metrics-file", metrics, "--no-print-config"]) == 0
    return handler.messages, lookups[0]


def _run(tmp_path: Path, name: str, kill_at: Any = None, **sections: Any) -> list[str]:
    metrics = str(tmp_path / f"{name}.jsonl")
    (messages,) = run_distributed(_launch, 1, metrics, kill_at, sections, timeout=150)
    return messages


def _losses(tmp_path: Path, name: str) -> dict[int, float]:
    path = tmp_path / f"{name}.jsonl"
    return {int(r["step"]): r["lm loss"] for r in read_metrics_file(path) if "lm loss" in r}


def test_pretrained_ckpt_step_and_non_persistent_resume(tmp_path: Path) -> None:
    trained = tmp_path / "trained"
    fresh = _run(
        tmp_path,
        "trained",
        train=tiny_train_config(train_iters=4),
        checkpoint=CheckpointConfig(save=str(trained), save_interval=2),
    )
    assert fresh == []  # nothing to load in a new save directory
    assert (trained / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    reference = _losses(tmp_path, "trained")

    # An empty load directory: the pretrained checkpoint's weights are used, from step 0.
    empty = tmp_path / "empty"
    empty.mkdir()
    messages = _run(
        tmp_path,
        "pretrained",
        train=tiny_train_config(train_iters=2),
        checkpoint=CheckpointConfig(load=str(empty), pretrained_checkpoint=str(trained)),
    )
    assert any(
        "checkpoint.pretrained_checkpoint checkpoint of iteration 4" in m for m in messages
    ), messages
    finetuned = _losses(tmp_path, "pretrained")
    assert sorted(finetuned) == [1, 2]  # iteration counting restarts
    # The same first batch as the fresh run, but through the trained weights.
    assert finetuned[1] < reference[1]

    # ckpt_step on a directory whose tracker is gone: the complete iter_0000002 is loaded.
    untracked = tmp_path / "untracked"
    shutil.copytree(trained, untracked)
    (untracked / "latest_checkpointed_iteration.txt").unlink()
    messages = _run(
        tmp_path,
        "step2",
        train=tiny_train_config(train_iters=4),
        checkpoint=CheckpointConfig(load=str(untracked), ckpt_step=2),
    )
    assert any("checkpoint.load checkpoint of iteration 2" in m for m in messages), messages
    resumed = _losses(tmp_path, "step2")
    assert sorted(resumed) == [3, 4]
    assert resumed == {3: reference[3], 4: reference[4]}  # exact continuation

    # The tracker names a torn iteration 4: bridge-train's checks, pretrain's checks and the
    # load all resume iteration 2, looked up once in the launch and reported once.
    torn = tmp_path / "torn"
    shutil.copytree(trained, torn)
    (torn / "iter_0000004" / "checkpoint_complete.json").unlink()
    ((messages, lookups),) = run_distributed(
        _launch_command, 1, str(tmp_path / "torn.jsonl"), str(torn), timeout=150
    )
    assert lookups == 1
    assert sum("The tracker" in m and "names iteration 4" in m for m in messages) == 1, messages
    assert any("checkpoint.load checkpoint of iteration 2" in m for m in messages), messages
    assert _losses(tmp_path, "torn") == resumed

    # Only non-persistent checkpoints exist when the run dies: the next launch resumes
    # from the newest one, and the end of training writes a persistent checkpoint.
    volatile = tmp_path / "volatile"
    np_sections: dict[str, Any] = {
        "train": tiny_train_config(train_iters=4),
        "checkpoint": CheckpointConfig(
            save=str(volatile),
            non_persistent_save_interval=2,
            non_persistent_ckpt_type="global",
        ),
    }
    with pytest.raises(DistributedTestError, match="exit codes"):
        _run(tmp_path, "killed", kill_at=4, **np_sections)
    assert not (volatile / "latest_checkpointed_iteration.txt").exists()
    assert (volatile / "non_persistent" / "latest_checkpointed_iteration.txt").exists()
    messages = _run(tmp_path, "after_kill", **np_sections)
    assert any("non-persistent checkpoint of iteration 2" in m for m in messages), messages
    assert _losses(tmp_path, "after_kill") == {3: reference[3], 4: reference[4]}
    assert (volatile / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
