"""Real faults against real launches: SIGTERM, SIGKILL, kills during a save, hung ranks.

Each test launches the tiny loop of ``resiliency_drill.py`` (beside this file) on 2 gloo ranks under
``torchrun`` or nvidia-resiliency-ext's ``ft_launcher``, injects faults, and checks that the
job ends the way it must and that every loss and the final weights equal an uninterrupted
run's, bit for bit. Faults are driven per launch attempt (``--fault-plan``), so one launch
with restarts covers several faults.

Simulated faults strike ``fault_delay + uniform(0, 0.1 * fault_delay + 1)`` seconds after
setup, and every step sleeps ``step_sleep`` seconds, so an attempt hit by one trains at most
``(1.1 * fault_delay + 1) / step_sleep`` steps however fast the machine is (it may train
fewer on a loaded one). ``train_iters`` is chosen from that bound so that every planned
fault strikes before the run could finish, and the last attempt trains enough steps.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
import torch
from resiliency_drill import (
    StepCheckpointer,
    TinyRunOptions,
    TinyRunResult,
    read_events,
    run_tiny_training,
)

from bridge.resiliency import WatchdogTimeouts
from bridge.resiliency._nvrx_monitor import MIN_STEPS_FOR_TIMEOUT
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


def _assert_watchdog_caught_the_hang(drill, output: str, timeouts: WatchdogTimeouts) -> None:
    """The hung rank's watchdog killed it within the timeout of the phase it hung in."""
    (hang,) = drill.faults(output, "rank_hung")
    kills = [k for k in drill.watchdog_kills(output) if k["pid"] == hang["pid"]]
    assert len(kills) == 1, (hang, drill.watchdog_kills(output))
    (kill,) = kills
    warmup = kill["phase"].endswith("(warm-up)")
    expected = timeouts.setup if warmup else timeouts.for_phase(kill["phase"])
    assert kill["timeout"] == expected, (kill, timeouts)
    # Measured from the moment the rank stopped (the fault's timestamp) to the kill.
    latency = kill["time"] - hang["time"]
    assert 0 <= latency <= kill["timeout"] + drill.detection_slack, (hang, kill)


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_torchrun_restarts_after_kills_and_a_hang_without_losing_a_step(
    tmp_path: Path, drill, reference
) -> None:
    """``torchrun --max-restarts`` with the built-in hang watchdog (no nvidia-resiliency-ext).

    Attempt 0: rank 0 is SIGKILLed while writing iteration 20 (before the rename) -> the
    restart loads iteration 10. Attempt 1: rank 0 is SIGKILLed after renaming iteration 20's
    complete directory into place and before the tracker names it -> the restart loads
    iteration 10 again, never the half-committed 20. Attempt 2: ``rank_killed`` on rank 1.
    Attempt 3: ``rank_hung`` on rank 1, killed by its watchdog within the timeout. Attempt 4
    finishes. Faulted attempts train at most 42 steps (fault_delay 1, step_sleep 0.05): the
    last one starts at iteration 90 at the latest.
    """
    train_iters = 100
    save_dir, log_dir = tmp_path / "ckpt", tmp_path / "log"
    # Room for a loaded machine: with a 4 s step timeout, beside two CPU hogs and other jobs
    # (load average 31 on 2 cores), a healthy rank's step stalled past it and was killed.
    timeouts = WatchdogTimeouts(step=10.0, setup=30.0, checkpointing=20.0, out_of_section=20.0)
    options = TinyRunOptions(
        save_dir=str(save_dir),
        log_dir=str(log_dir),
        train_iters=train_iters,
        step_sleep=0.05,
        kill_during_save_at=20,
        fault_plan=("none", "kill_before_tracker", "rank_killed", "rank_hung"),
        fault_rank=1,
        fault_delay=1,
        hang_timeout=timeouts,
    )
    log = tmp_path / "torchrun.log"
    # One restart more than planned: a spurious one (overloaded CI) must not fail the test.
    cmd = drill.torchrun_cmd(2, ["--max-restarts=5"], options)
    with drill.launched(cmd, log=log) as proc:
        returncode = drill.wait_for(proc, 380, log)
    output = drill.tail(log, 300_000)
    assert returncode == 0, drill.tail(log)
    events = drill.assert_matches_reference(save_dir, log_dir, reference(train_iters), train_iters)
    starts = {e["attempt"]: e for e in events if e["event"] == "start"}
    assert {0, 1, 2, 3, 4} <= set(starts), sorted(starts)
    assert all(s["ft_monitor"] == "watchdog" for s in starts.values())
    # The kill mid-save: iteration 20 was being written, iteration 10 is what attempt 1 loads.
    killed = [(e["attempt"], e["iteration"]) for e in events if e["event"] == "killing_mid_save"]
    assert killed == [(0, 20)]
    assert starts[1]["iteration"] == 10
    # The kill between rename and tracker: the complete but untracked iteration 20 is not
    # loaded; attempt 2 resumes from 10 and writes iteration 20 again.
    (half,) = [e for e in events if e["event"] == "killing_before_tracker"]
    assert (half["attempt"], half["iteration"]) == (1, 20)
    assert Path(half["path"]) == save_dir / "iter_0000020"
    assert starts[2]["iteration"] == 10
    saved_20 = [e["attempt"] for e in events if e["event"] == "saved" and e["iteration"] == 20]
    assert len(saved_20) == 1 and saved_20[0] >= 2, saved_20
    assert "simulating fault 'rank_killed' on rank 1" in output
    assert "simulating fault 'rank_hung' on rank 1" in output
    _assert_watchdog_caught_the_hang(drill, output, timeouts)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_hung_rank_without_restarts_tears_the_job_down(tmp_path: Path, drill) -> None:
    """``--max-restarts=0``: the watchdog kills the hung rank within its timeout, torchrun
    stops the other rank and exits non-zero; nothing is left running or hanging."""
    save_dir, log_dir = tmp_path / "ckpt", tmp_path / "log"
    timeouts = WatchdogTimeouts(step=10.0, setup=30.0, checkpointing=20.0, out_of_section=20.0)
    options = TinyRunOptions(
        save_dir=str(save_dir),
        log_dir=str(log_dir),
        train_iters=10_000,  # never reached: the job must end because of the hang
        step_sleep=0.05,
        fault_plan=("rank_hung",),
        fault_rank=1,
        fault_delay=1,
        hang_timeout=timeouts,
    )
    log = tmp_path / "torchrun.log"
    with drill.launched(drill.torchrun_cmd(2, ["--max-restarts=0"], options), log=log) as proc:
        returncode = drill.wait_for(proc, 180, log)
    output = drill.tail(log, 300_000)
    assert returncode != 0, drill.tail(log)
    _assert_watchdog_caught_the_hang(drill, output, timeouts)
    # The launcher reports the killed rank and gives up (no restart left).
    (hang,) = drill.faults(output, "rank_hung")
    assert re.search(rf"exitcode\s*: -9 \(pid: {hang['pid']}\)", output), drill.tail(log)
    assert "ChildFailedError" in output
    events = read_events(log_dir)
    assert {e["attempt"] for e in events} == {0}  # no restart
    assert not [e for e in events if e["event"] in ("finished", "exit")]
    # Both ranks are gone once the launcher has exited.
    for rank in (0, 1):
        pid = int((log_dir / f"rank{rank}.pid").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # The checkpoints written before the hang are intact.
    saved = [e["iteration"] for e in events if e["event"] == "saved"]
    loaded = StepCheckpointer(save_dir, rank=0).load()
    assert (loaded.iteration if loaded is not None else None) == max(saved, default=None)


def _stop_run(rank: int, world: int, options: TinyRunOptions) -> TinyRunResult:
    torch.set_num_threads(1)
    return run_tiny_training(options)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_straggler_stop_request_saves_on_every_rank_and_exits_zero(
    tmp_path: Path, reference
) -> None:
    """``nvrx_straggler.stop_if_detected``: rank 0's monitor finds a straggler after
    iteration 13 (a saving iteration is 10, 20, ...); every rank stops after that same
    iteration, one checkpoint of it is written, and every rank's exit code is 0."""
    train_iters = 40
    save_dir, log_dir = tmp_path / "ckpt", tmp_path / "log"
    options = TinyRunOptions(
        save_dir=str(save_dir),
        log_dir=str(log_dir),
        train_iters=train_iters,
        nvrx_straggler_report_at=13,
    )
    results = run_distributed(_stop_run, 2, options, timeout=150)
    for result in results:
        decision = result.decision
        assert (decision.should_exit, decision.reason, result.iteration) == (
            True,
            "stop_request",
            13,
        ), result.rank
        assert decision.should_save and decision.exit_code == 0
    events = read_events(log_dir)
    assert [e["iteration"] for e in events if e["event"] == "saved"] == [10, 13]
    (exit_event,) = [e for e in events if e["event"] == "exit"]
    assert (exit_event["iteration"], exit_event["reason"]) == (13, "stop_request")
    loaded = StepCheckpointer(save_dir, rank=0).load()
    assert loaded is not None and loaded.iteration == 13
    expected = reference(train_iters)
    for rank, result in enumerate(results):
        assert result.losses == {i: expected[rank].losses[i] for i in range(1, 14)}
        for name, tensor in result.state.items():
            assert torch.equal(loaded.state["model"][name], tensor), name


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_ft_launcher_detects_a_hang_and_a_kill_and_keeps_computed_timeouts(
    nvrx: None, tmp_path: Path, drill, reference
) -> None:
    """nvidia-resiliency-ext's ``ft_launcher`` + rank monitor (sections, computed timeouts).

    Attempt 0: ``rank_hung`` on rank 1, detected by the rank monitor within the timeout in
    force. Attempt 1: ``rank_killed``. Attempt 2 finishes. Timeouts computed from observed
    steps and saves are stored in ``ft_state.json`` next to the checkpoints and loaded by
    later attempts; the out-of-section timeout is computed at the clean shutdown of a run
    that loaded a checkpoint, saved and trained at least ``MIN_STEPS_FOR_TIMEOUT`` steps.

    That last condition is what made this drill flaky when the faults were close to the
    end of the run: the faulted attempts train at most 64 steps each (fault_delay 2,
    step_sleep 0.05), so attempt 1 could end past iteration 90 of 100 (leaving attempt 2
    fewer than 16 steps: no out-of-section timeout) or even finish. With 140 iterations,
    attempt 2 starts at iteration 120 at the latest and trains at least 20 steps.
    """
    train_iters = 140
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
            "--ft-rank-section-timeouts=setup:120,step:6,checkpointing:10",
            # Out of section: the warm-up step, the pauses between steps and the end of the
            # run (shutdown, writing ft_state.json). With 6 s, a run beside two CPU hogs and
            # other jobs ended with an unplanned attempt that had no step left to train (so
            # no out-of-section timeout was computed): a healthy rank taken for hung after
            # its last save, by all signs (that log was not kept).
            "--ft-rank-out-of-section-timeout=30",
            # Computed timeouts are observed maxima times this factor, with no floor in
            # nvidia-resiliency-ext. Attempt 0 observes 0.05 s steps, so a factor of 40 gave
            # attempt 1 a ~2.4 s step timeout: on a loaded machine a rank descheduled that
            # long was "hung", an unplanned restart shifted the per-attempt fault plan, and
            # the planned rank_killed never fired. 400 puts the computed timeouts (~20 s)
            # above any scheduling stall while detection in attempt 0 still uses the
            # configured 6 s (nothing is computed before a first attempt ends).
            "--ft-safety-factor=400",
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
    # Detected within the timeout in force (configured, or computed by then) plus the
    # monitor's check interval, measured from the moment the rank stopped.
    (hang,) = drill.faults(output, "rank_hung")
    detections = [d for d in drill.rank_monitor_timeouts(output) if d["time"] > hang["time"]]
    assert detections, drill.tail(log)
    first = min(detections, key=lambda d: d["time"])
    latency = first["time"] - hang["time"]
    assert latency <= first["timeout"] + 1.0 + drill.detection_slack, (hang, first)
    # The precondition of the out-of-section timeout holds by construction (see above).
    last = max(starts)
    trained_last = [e for e in events if e["event"] == "step" and e["attempt"] == last]
    assert len(trained_last) >= MIN_STEPS_FOR_TIMEOUT, (last, len(trained_last))
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
