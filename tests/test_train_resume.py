"""Resuming is exact: stopping and resuming, or dying with SIGKILL between checkpoints, gives
the losses of an uninterrupted run bit for bit (CPU, two data-parallel ranks).

Runs (``pretrain`` on two forked gloo ranks, checkpoints every 10 iterations):

* reference: 40 iterations without interruption;
* interrupted: stops at iteration 20 (``train.exit_interval``), resumes, and every rank is
  killed with SIGKILL during iteration 35 (after the checkpoint of 30); the next launch
  resumes from 30 and trains 31-40 again.

And ``bridge-train`` under ``torchrun --max-restarts=1`` with one rank SIGKILLed: the
restart resumes exactly (launch helpers and reference run: tests/test_train_fault_drills.py).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from bridge.config import CheckpointConfig, LoggerConfig
from bridge.train import forward_step, pretrain
from bridge.train.metrics import read_metrics_file
from bridge.train.testing import tiny_config_container, tiny_train_config
from core_utils.testing import DistributedTestError, run_distributed


def _run(
    rank: int,
    world: int,
    save: str,
    metrics: str,
    exit_interval: Any,
    kill_at: Any,
) -> int:
    def step(state: Any, data_iterator: Any, model: Any) -> Any:
        if kill_at is not None and state.train_state.step == kill_at - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # every rank dies, as when a node is lost
        return forward_step(state, data_iterator, model)

    cfg = tiny_config_container(
        train=tiny_train_config(
            train_iters=40,
            global_batch_size=8,
            micro_batch_size=2,
            exit_interval=exit_interval,
        ),
        logger=LoggerConfig(log_interval=10, log_progress=True),
        checkpoint=CheckpointConfig(save=save, save_interval=10),
    )
    return pretrain(cfg, step, metrics_file=f"{metrics}.{rank}")


def _losses(path: Path) -> dict[int, float]:
    if not path.exists():
        return {}
    return {int(r["step"]): r["lm loss"] for r in read_metrics_file(path) if "lm loss" in r}


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_resume_and_kill_between_checkpoints_are_exact(tmp_path: Path) -> None:
    ref, run = tmp_path / "reference", tmp_path / "interrupted"
    assert run_distributed(_run, 2, str(ref), str(tmp_path / "ref"), None, None, timeout=120) == [
        0,
        0,
    ]
    reference = _losses(tmp_path / "ref.1")  # the last rank writes the metrics
    assert sorted(reference) == list(range(1, 41))

    first = tmp_path / "first"
    assert run_distributed(_run, 2, str(run), str(first), 20, None, timeout=120) == [0, 0]
    assert (run / "latest_checkpointed_iteration.txt").read_text().strip() == "20"
    time.sleep(1.1)  # one progress.txt line per second of resolution

    killed = tmp_path / "killed"
    with pytest.raises(DistributedTestError, match="exit codes"):
        run_distributed(_run, 2, str(run), str(killed), None, 35, timeout=120)
    assert (run / "latest_checkpointed_iteration.txt").read_text().strip() == "30"
    time.sleep(1.1)

    last = tmp_path / "last"
    assert run_distributed(_run, 2, str(run), str(last), None, None, timeout=120) == [0, 0]
    assert (run / "latest_checkpointed_iteration.txt").read_text().strip() == "40"

    stopped, after_kill, resumed = (_losses(Path(f"{p}.1")) for p in (first, killed, last))
    assert sorted(stopped) == list(range(1, 21))
    assert sorted(resumed) == list(range(31, 41))  # resumed from the checkpoint of 30
    assert set(range(21, 31)) <= set(after_kill)  # (lines after 30 may die with the rank)
    for losses in (stopped, after_kill, resumed):
        for step, loss in losses.items():
            assert loss == reference[step], f"step {step}: {loss!r} != {reference[step]!r}"

    progress = (run / "progress.txt").read_text().splitlines()
    assert sum("\tStarting job" in line for line in progress) == 3
    assert all("# GPUs: 2" in line for line in progress)


def _drill_kit() -> ModuleType:
    """``tests/test_train_fault_drills.py``: the torchrun launch helpers and the shared
    uninterrupted reference run of the drill config.

    tests/ is not a package: use the module pytest imported, else import it by path (under
    the name pytest gives it, so it is imported once and the reference is computed once).
    """
    path = Path(__file__).resolve().with_name("test_train_fault_drills.py")
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file is not None and Path(file).resolve() == path:
            return module
    name = "tests.test_train_fault_drills"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_torchrun_restarts_a_killed_rank_and_finishes(tmp_path: Path) -> None:
    """``torchrun --max-restarts=1``: SIGKILL rank 1 right after the checkpoint of iteration
    10; the launcher restarts both ranks, which resume from the last complete checkpoint (the
    trainer's process group set-up is restart-safe) and finish. The restart's first step is
    the one after the checkpoint the tracker named at the kill, no step is missing, and every
    logged loss (retrained steps included) equals the uninterrupted run's, bit for bit."""
    kit = _drill_kit()
    reference = kit.reference_losses()
    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    args = [
        "--metrics-file",
        str(metrics),
        *kit.DRILL_OVERRIDES,
        f"checkpoint.save={save}",
        "checkpoint.save_interval=10",
    ]
    log = tmp_path / "torchrun.log"
    with kit.launched(kit.torchrun_command(args, max_restarts=1), log=log, cwd=tmp_path) as proc:
        kit.wait_until(
            lambda: (kit.tracker_iteration(save) or 0) >= 10,
            proc,
            300,
            "checkpoint of iteration 10",
            log,
        )
        rank1 = kit.rank_processes(proc)[1]
        rank1.kill()  # the next save is 10 iterations away: none is in progress
        tracker_at_kill = kit.tracker_iteration(save)
        returncode = kit.wait_for_exit(proc, 300, log)
    output = log.read_text()
    assert returncode == 0, kit.tail(log)
    assert f"(pid: {rank1.pid})" in output  # torchrun saw the failure and restarted
    assert kit.loaded_message(save, tracker_at_kill) in output
    records = kit.loss_records(metrics)
    kit.assert_restarted_from([step for step, _ in records], tracker_at_kill)
    kit.assert_losses_match(records, reference)
    assert kit.tracker_iteration(save) == kit.TRAIN_ITERS
    progress = (save / "progress.txt").read_text()
    assert progress.count("Starting job") == 2
