"""Simulated faults really kill or stop the process; the watchdog really kills a hung rank."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import pytest

from bridge.config import FaultToleranceConfig
from bridge.resiliency import (
    ActiveFaultTolerance,
    FaultTolerance,
    HangWatchdog,
    ResiliencyError,
    SimulatedFault,
    WatchdogTimeouts,
)
from bridge.resiliency.simulated_fault import extra_delay_bound
from core_utils.testing import ignored_signals, run_distributed

_FORK = mp.get_context("fork")


def test_disabled_config_schedules_nothing() -> None:
    assert SimulatedFault.from_config(None) is None
    assert SimulatedFault.from_config(FaultToleranceConfig()) is None


def test_config_is_resolved_as_configured() -> None:
    config = FaultToleranceConfig(
        simulate_fault=True,
        simulated_fault_type="rank_killed",
        simulated_fault_rank=1,
        simulated_fault_base_delay=7,
    )
    for seed in range(20):
        fault = SimulatedFault.from_config(config, rank=0, world_size=2, seed=seed)
        assert fault is not None
        assert (fault.fault_type, fault.target_rank, fault.is_target) == ("rank_killed", 1, False)
        assert 7.0 <= fault.delay <= 7.0 + extra_delay_bound(7.0) == 8.7
    random_type = FaultToleranceConfig(simulate_fault=True, simulated_fault_type="random")
    kinds = set()
    for seed in range(40):
        fault = SimulatedFault.from_config(random_type, rank=0, world_size=1, seed=seed)
        assert fault is not None and fault.target_rank == 0 and fault.is_target
        assert 0.0 <= fault.delay <= 1.0
        kinds.add(fault.fault_type)
    assert kinds == {"rank_hung", "rank_killed"}


def test_bad_fault_settings_are_reported() -> None:
    config = FaultToleranceConfig(simulate_fault=True, simulated_fault_rank=3)
    with pytest.raises(
        ResiliencyError, match="simulated_fault_rank: got 3; the job has ranks 0 to 1"
    ):
        SimulatedFault.from_config(config, rank=0, world_size=2)
    with pytest.raises(ResiliencyError, match="fault_type: got 'rank_slow'"):
        SimulatedFault(fault_type="rank_slow", target_rank=0, delay=0, rank=0)  # type: ignore[arg-type]
    with pytest.raises(ResiliencyError, match="delay: got -1"):
        SimulatedFault(fault_type="rank_hung", target_rank=0, delay=-1, rank=0)


def _random_rank(rank: int, world: int) -> int:
    config = FaultToleranceConfig(simulate_fault=True, simulated_fault_type="rank_hung")
    # Different seeds per rank: only the broadcast makes them agree.
    fault = SimulatedFault.from_config(config, seed=rank * 7919 + 1)
    assert fault is not None
    return fault.target_rank


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_random_target_rank_is_agreed_by_broadcast() -> None:
    targets = run_distributed(_random_rank, 2, timeout=90)
    assert targets[0] == targets[1] and targets[0] in (0, 1)


def _run_fault(fault_type: str, counter: Any, delay: float) -> None:
    fault = SimulatedFault(fault_type=fault_type, target_rank=0, delay=delay, rank=0)  # type: ignore[arg-type]
    fault.start()
    fault.start()  # idempotent
    while True:  # "training": make progress until the fault hits
        with counter.get_lock():
            counter.value += 1
        time.sleep(0.01)


@pytest.mark.timeout(60)
def test_rank_killed_dies_of_sigkill() -> None:
    counter = _FORK.Value("i", 0)
    proc = _FORK.Process(target=_run_fault, args=("rank_killed", counter, 0.3))
    proc.start()
    proc.join(timeout=45)
    assert proc.exitcode == -signal.SIGKILL
    assert counter.value > 0


@pytest.mark.timeout(60)
def test_rank_hung_stops_making_progress() -> None:
    counter = _FORK.Value("i", 0)
    proc = _FORK.Process(target=_run_fault, args=("rank_hung", counter, 0.3))
    proc.start()
    assert proc.pid is not None
    try:
        _, status = os.waitpid(proc.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status) and os.WSTOPSIG(status) == signal.SIGSTOP
        frozen = counter.value
        time.sleep(0.5)
        assert counter.value == frozen > 0  # alive but no progress at all
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        os.waitpid(proc.pid, 0)


def test_watchdog_timeouts_are_checked() -> None:
    with pytest.raises(ResiliencyError, match=r"WatchdogTimeouts\.step: got 0"):
        WatchdogTimeouts(step=0)
    with pytest.raises(ResiliencyError, match=r"checkpointing: got -5.*or None to switch it off"):
        WatchdogTimeouts(step=1, checkpointing=-5)
    timeouts = WatchdogTimeouts(step=2, setup=None, checkpointing=9)
    assert timeouts.for_phase("out_of_section") == 2 and timeouts.for_phase("setup") is None
    with pytest.raises(ResiliencyError, match="phase: got 'eval'"):
        timeouts.for_phase("eval")


def test_watchdog_timeouts_parse_command_line_values() -> None:
    assert WatchdogTimeouts.parse("45") == WatchdogTimeouts(step=45.0)
    full = WatchdogTimeouts.parse(" step:60, setup:900,checkpointing:600,out_of_section:30 ")
    assert full == WatchdogTimeouts(step=60, setup=900, checkpointing=600, out_of_section=30)
    assert WatchdogTimeouts.parse("step:2.5,setup:none") == WatchdogTimeouts(step=2.5)
    for timeouts in (full, WatchdogTimeouts(step=0.25, checkpointing=1e6)):
        assert WatchdogTimeouts.parse(str(timeouts)) == timeouts
    assert str(full) == "step:60,setup:900,checkpointing:600,out_of_section:30"
    for bad, message in [
        ("fast", r"step got 'fast', not a number of seconds > 0"),
        ("setup:900", "a step timeout in seconds is required"),
        ("step:none", "a step timeout in seconds is required"),
        ("step:60,eval:5", r"'eval:5' is not phase:seconds with a phase among step, setup"),
        ("step:60,step:30", "phase 'step' given twice"),
        ("step:60,checkpointing:-1", r"checkpointing got '-1', not a number of seconds > 0"),
    ]:
        with pytest.raises(ResiliencyError, match=message):
            WatchdogTimeouts.parse(bad)


def _slow_first_step_then_hang(timeouts: WatchdogTimeouts, first_step: float, done: Any) -> None:
    ft = FaultTolerance.from_config(None, rank=2, world_size=4, hang_timeout=timeouts)
    assert isinstance(ft, ActiveFaultTolerance)
    ft.on_setup_start()
    ft.on_setup_end()
    for step in range(1, 4):
        ft.on_step_start()
        time.sleep(first_step if step == 1 else 0.01)
        ft.on_step_end()
        done.value = step
    ft.on_step_start()
    SimulatedFault(fault_type="rank_hung", target_rank=0, delay=0.0, rank=0).start()
    time.sleep(120)  # never reached: the process is stopped, then killed


@pytest.mark.timeout(90)
def test_watchdog_spares_a_slow_warm_up_step_and_kills_a_later_hang(
    capfd: pytest.CaptureFixture[str],
) -> None:
    # The first step takes 2.5 step timeouts: the warm-up runs under the setup timeout.
    done = _FORK.Value("i", 0)
    timeouts = WatchdogTimeouts(step=1.0, setup=8.0)
    proc = _FORK.Process(target=_slow_first_step_then_hang, args=(timeouts, 2.5, done))
    proc.start()
    proc.join(timeout=60)
    assert proc.exitcode == -signal.SIGKILL
    assert done.value == 3  # the slow first step and two more finished; step 4 hung
    err = capfd.readouterr().err
    assert "HangWatchdog: rank 2" in err and "no progress for 1.0 s in phase 'step'" in err
    assert "warm-up" not in err


@pytest.mark.timeout(90)
def test_watchdog_holds_the_warm_up_step_to_the_setup_timeout(
    capfd: pytest.CaptureFixture[str],
) -> None:
    done = _FORK.Value("i", 0)
    timeouts = WatchdogTimeouts(step=30.0, setup=1.0)
    proc = _FORK.Process(target=_slow_first_step_then_hang, args=(timeouts, 60.0, done))
    proc.start()
    proc.join(timeout=60)
    assert proc.exitcode == -signal.SIGKILL and done.value == 0
    err = capfd.readouterr().err
    assert "no progress for 1.0 s in phase 'step (warm-up)'" in err


def _hang_under_watchdog(step_timeout: float, watchdog_pid: Any) -> None:
    watchdog = HangWatchdog(WatchdogTimeouts(step=step_timeout), rank=3)
    watchdog.start()
    assert watchdog._process is not None
    watchdog_pid.value = watchdog._process.pid
    watchdog.enter("step")
    fault = SimulatedFault(fault_type="rank_hung", target_rank=0, delay=0.0, rank=0)
    fault.start()
    time.sleep(120)  # never reached: the process is stopped, then killed


@pytest.mark.timeout(90)
def test_watchdog_kills_a_hung_rank(capfd: pytest.CaptureFixture[str]) -> None:
    watchdog_pid = _FORK.Value("i", 0)
    proc = _FORK.Process(target=_hang_under_watchdog, args=(1.0, watchdog_pid))
    started = time.monotonic()
    proc.start()
    proc.join(timeout=60)
    assert proc.exitcode == -signal.SIGKILL
    assert time.monotonic() - started >= 1.0  # never before its timeout
    err = capfd.readouterr().err
    assert "HangWatchdog: rank 3" in err and "no progress for 1.0 s in phase 'step'" in err
    _wait_gone(watchdog_pid.value)


def _beat_then_exit(watchdog_pid: Any) -> None:
    with HangWatchdog(WatchdogTimeouts(step=5.0), rank=0) as watchdog:
        assert watchdog._process is not None
        watchdog_pid.value = watchdog._process.pid
        for _ in range(20):
            watchdog.enter("step")
            time.sleep(0.02)
            watchdog.enter("out_of_section")
    os._exit(0)


@pytest.mark.timeout(90)
def test_watchdog_leaves_a_progressing_rank_alone() -> None:
    watchdog_pid = _FORK.Value("i", 0)
    proc = _FORK.Process(target=_beat_then_exit, args=(watchdog_pid,))
    proc.start()
    proc.join(timeout=60)
    assert proc.exitcode == 0
    _wait_gone(watchdog_pid.value)


def _die_with_watchdog_running(watchdog_pid: Any) -> None:
    watchdog = HangWatchdog(WatchdogTimeouts(step=60.0), rank=0)
    watchdog.start()
    assert watchdog._process is not None
    watchdog_pid.value = watchdog._process.pid
    os._exit(7)  # dies without stopping its watchdog


@pytest.mark.timeout(90)
def test_watchdog_exits_when_its_rank_dies() -> None:
    watchdog_pid = _FORK.Value("i", 0)
    proc = _FORK.Process(target=_die_with_watchdog_running, args=(watchdog_pid,))
    proc.start()
    proc.join(timeout=60)
    assert proc.exitcode == 7
    _wait_gone(watchdog_pid.value)


@pytest.mark.timeout(90)
def test_watchdog_outlives_the_signals_a_scheduler_stops_a_job_with() -> None:
    # srun delivers a time-limit SIGUSR1 to every process of a SLURM step; the watchdog
    # must go on watching its rank while the rank saves.
    watchdog = HangWatchdog(WatchdogTimeouts(step=60.0), rank=0)
    watchdog.start()
    process = watchdog._process
    assert process is not None
    stop_signals = {signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2}
    deadline = time.monotonic() + 60
    while not stop_signals <= ignored_signals(process.pid):  # set once it has started
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.05)
    for sig in stop_signals:
        os.kill(process.pid, sig)
    watchdog.enter("step")
    assert watchdog.running
    watchdog.stop()
    assert process.returncode == 0  # it left when told to, not of a signal


def _wait_gone(pid: int, timeout: float = 30.0) -> None:
    """Wait until ``pid`` no longer exists (orphans are reaped by init)."""
    assert pid > 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        # A zombie child of this process would also count as alive: reap if ours.
        try:
            if os.waitpid(pid, os.WNOHANG) != (0, 0):
                return
        except ChildProcessError:
            pass
        time.sleep(0.1)
    pytest.fail(f"watchdog process {pid} is still running")
