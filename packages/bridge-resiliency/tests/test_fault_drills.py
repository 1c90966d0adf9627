"""Real faults against real launches: SIGTERM, SIGKILL, a kill mid-save and hung ranks.

Each test launches the tiny loop of ``bridge.resiliency.testing`` on 2 gloo ranks under
``torchrun`` or nvidia-resiliency-ext's ``ft_launcher``, injects faults, and checks that the
job ends the way it must and that every loss and the final weights equal an uninterrupted
run's, bit for bit. Faults are driven per launch attempt (``--fault-plan``), so one launch
with restarts covers several faults.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from bridge.resiliency.testing import (
    StepCheckpointer,
    TinyRunOptions,
    TinyRunResult,
    read_events,
    run_tiny_training,
)
from core_utils.testing import run_distributed


def _resume(rank: int, world: int, options: TinyRunOptions) -> TinyRunResult:
    torch.set_num_threads(1)
    return run_tiny_training(options)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_sigterm_saves_on_every_rank_exits_zero_and_resumes_exactly(
    tmp_path: Path, drill, reference
) -> None:
    """SIGTERM to one rank: all ranks stop at the same step, save once, exit 0; a second
    SIGTERM to the saving rank during the save changes nothing; resuming reaches the
    uninterrupted run's weights and losses."""
    train_iters = 40
    save_dir, log_dir = tmp_path / "ckpt", tmp_path / "log"
    options = TinyRunOptions(
        save_dir=str(save_dir),
        log_dir=str(log_dir),
        train_iters=train_iters,
        step_sleep=0.1,
        exit_signal_handler=True,
        exit_save_delay=2.0,
    )
    log = tmp_path / "torchrun.log"
    with drill.launched(drill.torchrun_cmd(2, [], options), log=log) as proc:
        drill.wait_until(
            lambda: any(e.get("iteration", 0) >= 12 for e in read_events(log_dir)),
            240,
            "iteration 12",
            log,
        )
        rank1 = int((log_dir / "rank1.pid").read_text())
        os.kill(rank1, signal.SIGTERM)
        drill.wait_until(
            lambda: any(e["event"] == "exit_save_in_progress" for e in read_events(log_dir)),
            120,
            "the exit save",
            log,
        )
        # Second signals while rank 0 is writing the checkpoint: deferred, not fatal.
        rank0 = int((log_dir / "rank0.pid").read_text())
        os.kill(rank0, signal.SIGTERM)
        os.kill(rank1, signal.SIGTERM)
        returncode = drill.wait_for(proc, 120, log)
    assert returncode == 0, drill.tail(log)
    events = read_events(log_dir)
    (exit_event,) = [e for e in events if e["event"] == "exit"]
    stopped_at = exit_event["iteration"]
    assert exit_event["reason"] == "signal" and 12 <= stopped_at < train_iters
    assert max(e["iteration"] for e in events if e["event"] == "step") == stopped_at
    loaded = StepCheckpointer(save_dir, rank=0).load()
    assert loaded is not None and loaded.iteration == stopped_at
    assert not list(save_dir.glob(".*tmp*")), "the interrupted save left a partial directory"

    # The resumed run is the launcher's next attempt as far as the event log is concerned.
    resumed = run_distributed(
        _resume, 2, options, timeout=180, env={"TORCHELASTIC_RESTART_COUNT": "1"}
    )
    expected = reference(train_iters)
    for rank, result in enumerate(resumed):
        assert result.start_iteration == stopped_at
        assert result.iteration == train_iters
        for iteration, loss in result.losses.items():
            assert loss == expected[rank].losses[iteration], (rank, iteration)
        for name, tensor in expected[rank].state.items():
            assert torch.equal(result.state[name], tensor), name
    drill.assert_matches_reference(save_dir, log_dir, expected, train_iters)


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_torchrun_restarts_after_kills_and_a_hang_without_losing_a_step(
    tmp_path: Path, drill, reference
) -> None:
    """``torchrun --max-restarts`` with the built-in hang watchdog (no nvidia-resiliency-ext).

    Attempt 0: rank 0 is SIGKILLed in the middle of saving iteration 20 -> the restart
    loads iteration 10. Attempt 1: ``rank_killed`` on rank 1. Attempt 2: ``rank_hung`` on
    rank 1, killed by its watchdog after ``hang_timeout``. Attempt 3 finishes.
    """
    train_iters = 80
    save_dir, log_dir = tmp_path / "ckpt", tmp_path / "log"
    options = TinyRunOptions(
        save_dir=str(save_dir),
        log_dir=str(log_dir),
        train_iters=train_iters,
        step_sleep=0.05,
        kill_during_save_at=20,
        fault_plan=("none", "rank_killed", "rank_hung"),
        fault_rank=1,
        fault_delay=1,
        hang_timeout=4.0,
    )
    log = tmp_path / "torchrun.log"
    # One restart more than planned: a spurious one (overloaded CI) must not fail the test.
    cmd = drill.torchrun_cmd(2, ["--max-restarts=4"], options)
    with drill.launched(cmd, log=log) as proc:
        returncode = drill.wait_for(proc, 380, log)
    output = drill.tail(log, 200_000)
    assert returncode == 0, drill.tail(log)
    events = drill.assert_matches_reference(save_dir, log_dir, reference(train_iters), train_iters)
    starts = {e["attempt"]: e for e in events if e["event"] == "start"}
    assert {0, 1, 2, 3} <= set(starts), sorted(starts)
    assert all(s["ft_monitor"] == "watchdog" for s in starts.values())
    # The kill mid-save: iteration 20 was being written, iteration 10 is what attempt 1 loads.
    killed = [e for e in events if e["event"] == "killing_mid_save"]
    assert [e["iteration"] for e in killed] == [20]
    assert starts[1]["iteration"] == 10
    assert "simulating fault 'rank_killed' on rank 1" in output
    assert "simulating fault 'rank_hung' on rank 1" in output
    assert "HangWatchdog: rank 1" in output and "made no progress for 4.0 s" in output


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_ft_launcher_detects_a_hang_and_a_kill_and_keeps_computed_timeouts(
    nvrx: None, tmp_path: Path, drill, reference
) -> None:
    """nvidia-resiliency-ext's ``ft_launcher`` + rank monitor (sections, computed timeouts).

    Attempt 0: ``rank_hung`` on rank 1, detected by the rank monitor. Attempt 1:
    ``rank_killed``. Attempt 2 finishes. Timeouts computed from observed steps and saves
    are stored in ``ft_state.json`` next to the checkpoints and loaded by later attempts.
    """
    train_iters = 100
    save_dir, log_dir = tmp_path / "ckpt", tmp_path / "log"
    options = TinyRunOptions(
        save_dir=str(save_dir),
        log_dir=str(log_dir),
        train_iters=train_iters,
        step_sleep=0.05,
        fault_plan=("rank_hung", "rank_killed"),
        fault_rank=1,
        fault_delay=2,
        enable_ft_package=True,
        calc_ft_timeouts=True,
    )
    log = tmp_path / "ft_launcher.log"
    cmd = drill.ft_launcher_cmd(
        2,
        [
            "--max-restarts=3",
            "--ft-rank-section-timeouts=setup:120,step:6,checkpointing:60",
            "--ft-rank-out-of-section-timeout=6",
            # Computed timeouts are observed maxima times this factor; CI timing is noisy.
            "--ft-safety-factor=40",
        ],
        options,
    )
    with drill.launched(cmd, log=log) as proc:
        returncode = drill.wait_for(proc, 380, log)
    output = drill.tail(log, 400_000)
    assert returncode == 0, drill.tail(log)
    events = drill.assert_matches_reference(save_dir, log_dir, reference(train_iters), train_iters)
    starts = {e["attempt"]: e for e in events if e["event"] == "start"}
    assert {0, 1, 2} <= set(starts), sorted(starts)
    assert all(s["ft_monitor"] == "nvrx-sections" for s in starts.values())
    assert "simulating fault 'rank_hung' on rank 1" in output
    assert "simulating fault 'rank_killed' on rank 1" in output
    assert "FT timeout elapsed" in output  # the rank monitor, not a launcher, found the hang
    state = json.loads((save_dir / "ft_state.json").read_text())
    section = state["current_timeouts"]["section"]
    assert {"step", "checkpointing"} <= set(section["calculated_sections"])
    assert section["is_out_of_section_calculated"]  # stored by the clean final shutdown
    # Restarts start with the timeouts computed by earlier attempts (once there are some).
    loaded = [
        a for a, s in sorted(starts.items()) if "step" in s["ft_timeouts"]["calculated_sections"]
    ]
    assert loaded and loaded[0] > 0, {a: s["ft_timeouts"] for a, s in starts.items()}
    assert loaded == list(range(loaded[0], max(starts) + 1)), loaded


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_ft_launcher_heartbeat_mode_computes_heartbeat_timeouts(
    nvrx: None, tmp_path: Path, drill, reference
) -> None:
    """Without section timeouts the rank monitor gets heartbeats; the computed heartbeat
    timeouts are stored next to the checkpoints at the clean end of the run."""
    train_iters = 20
    save_dir, log_dir = tmp_path / "ckpt", tmp_path / "log"
    options = TinyRunOptions(
        save_dir=str(save_dir),
        log_dir=str(log_dir),
        train_iters=train_iters,
        enable_ft_package=True,
        calc_ft_timeouts=True,
    )
    log = tmp_path / "ft_launcher.log"
    cmd = drill.ft_launcher_cmd(
        1,
        ["--ft-initial-rank-heartbeat-timeout=300", "--ft-rank-heartbeat-timeout=120"],
        options,
    )
    with drill.launched(cmd, log=log) as proc:
        returncode = drill.wait_for(proc, 240, log)
    assert returncode == 0, drill.tail(log)
    events = read_events(log_dir)
    (start,) = [e for e in events if e["event"] == "start"]
    assert start["ft_monitor"] == "nvrx-heartbeats"
    assert start["ft_timeouts"] == {"initial": 300.0, "subsequent": 120.0, "calculated": False}
    assert [e["iteration"] for e in events if e["event"] == "step"] == list(range(1, 21))
    assert [e["loss"] for e in events if e["event"] == "step"] == [
        reference(train_iters, 1)[0].losses[i] for i in range(1, 21)
    ]
    heartbeat = json.loads((save_dir / "ft_state.json").read_text())["current_timeouts"][
        "heartbeat"
    ]
    assert heartbeat["were_calculated"]
    assert 0 < heartbeat["subsequent"] < 120.0
