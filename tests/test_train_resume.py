"""Resuming is exact: stopping and resuming, or dying with SIGKILL between checkpoints, gives
the losses of an uninterrupted run bit for bit (CPU, two data-parallel ranks).

Runs (``pretrain`` on two forked gloo ranks, checkpoints every 10 iterations):

* reference: 40 iterations without interruption;
* interrupted: stops at iteration 20 (``train.exit_interval``), resumes, and every rank is
  killed with SIGKILL during iteration 35 (after the checkpoint of 30); the next launch
  resumes from 30 and trains 31-40 again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from bridge.config import CheckpointConfig, LoggerConfig
from bridge.train import forward_step, pretrain, read_metrics_file
from bridge.train.testing import tiny_config_container, tiny_train_config
from core_utils.testing import DistributedTestError, run_distributed


def _run(rank: int, world: int, save: str, metrics: str, exit_interval: Any, kill_at: Any) -> int:
    def step(state: Any, data_iterator: Any, model: Any) -> Any:
        if kill_at is not None and state.train_state.step == kill_at - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # every rank dies, as when a node is lost
        return forward_step(state, data_iterator, model)

    cfg = tiny_config_container(
        train=tiny_train_config(
            train_iters=40, global_batch_size=8, micro_batch_size=2, exit_interval=exit_interval
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


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_torchrun_restarts_a_killed_rank_and_finishes(tmp_path: Path) -> None:
    """``torchrun --max-restarts=1``: SIGKILL one rank after the checkpoint of iteration 10;
    the launcher restarts both ranks, which resume from the last checkpoint (the trainer's
    process group set-up is restart-safe) and finish; retrained steps match bit for bit."""
    import subprocess
    import sys

    import psutil

    from core_utils.testing import find_free_port

    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--master-addr=127.0.0.1",
        f"--master-port={find_free_port()}",
        "-m",
        "bridge.train",
        "--no-print-config",
        "--metrics-file",
        str(metrics),
        "train.train_iters=60",
        "train.eval_interval=null",
        "train.eval_iters=0",
        "model.num_layers=2",
        "model.hidden_size=64",
        "model.seq_length=64",
        "scheduler.lr_warmup_iters=2",
        f"checkpoint.save={save}",
        "checkpoint.save_interval=10",
    ]
    log = tmp_path / "torchrun.log"
    tracker = save / "latest_checkpointed_iteration.txt"
    killed = None
    # Output goes to a file: a process the killed rank forked may outlive it and would hold
    # a pipe open. The new session lets the end of the test kill everything the launch left.
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            cwd=tmp_path,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 300
            while killed is None and time.monotonic() < deadline and proc.poll() is None:
                if tracker.exists() and int(tracker.read_text().strip() or 0) >= 10:
                    for child in psutil.Process(proc.pid).children():
                        if child.environ().get("RANK") == "1":
                            killed = child.pid
                            child.kill()
                time.sleep(0.05)
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
        finally:
            _kill_group(proc.pid)
            _kill_processes_mentioning(str(tmp_path))
    output = log.read_text()
    assert killed is not None, "the job finished before a rank could be killed"
    assert proc.returncode == 0, output[-4000:]
    assert f"(pid: {killed})" in output  # torchrun saw the failure and restarted
    assert tracker.read_text().strip() == "60"
    records = [r for r in read_metrics_file(metrics) if "lm loss" in r]
    first_seen: dict[int, float] = {}
    for record in records:  # a retrained step must repeat the first attempt exactly
        step = int(record["step"])
        assert first_seen.setdefault(step, record["lm loss"]) == record["lm loss"], step
    assert sorted(first_seen) == list(range(1, 61))
    progress = (save / "progress.txt").read_text()
    assert progress.count("Starting job") == 2


def _kill_group(pgid: int) -> None:
    """SIGKILL every process left in the launch's process group and wait until it is empty."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.1)


def _kill_processes_mentioning(marker: str) -> None:
    """SIGKILL processes of this launch that outlived it (found by a path unique to the test).

    A process a rank forked (dist_checkpointing's write-results helper) is re-parented when
    the rank is killed and lives in the rank's process group, not the launcher's.
    """
    import psutil

    for process in psutil.process_iter(["pid", "cmdline"]):
        cmdline = process.info.get("cmdline") or []
        if process.pid != os.getpid() and any(marker in part for part in cmdline):
            with contextlib.suppress(psutil.Error):
                process.kill()
