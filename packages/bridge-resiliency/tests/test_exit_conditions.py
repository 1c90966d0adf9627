"""Exit decisions: interval, duration, signal and stop requests, agreed across ranks."""

from __future__ import annotations

import os
import select
import signal
import threading
import time

import pytest

from bridge.config import TrainingConfig
from bridge.resiliency import (
    EXIT_CODE_CLEAN,
    DataloaderSignalGuard,
    ExitConditions,
    ExitDecision,
    ExitSignalHandler,
    ResiliencyError,
)
from core_utils.testing import run_distributed


class _Flag:
    def __init__(self, value: bool = False) -> None:
        self.value = value

    def stop_requested(self) -> bool:
        return self.value


def test_nothing_configured_never_exits_and_makes_no_collective() -> None:
    exits = ExitConditions.from_config(TrainingConfig(train_iters=10), save_enabled=True)
    assert not exits.is_collective
    assert exits.signal_handler is None
    for iteration in range(1, 50):
        assert exits.check(iteration) == ExitDecision()


def test_exit_interval_saves_once_per_iteration() -> None:
    exits = ExitConditions.from_config(
        TrainingConfig(train_iters=100, exit_interval=4), save_enabled=True
    )
    assert [exits.check(i).should_exit for i in range(1, 9)] == [
        False, False, False, True, False, False, False, True,
    ]  # fmt: skip
    decision = exits.check(8)
    assert decision.reason == "interval" and decision.should_save
    assert decision.exit_code == EXIT_CODE_CLEAN == 0
    assert "exit_interval=4" in decision.message
    # The loop already saved at this iteration (its save_interval): no second save.
    assert not exits.check(8, saved_this_iteration=True).should_save
    # Without checkpointing there is nothing to save.
    no_save = ExitConditions(exit_interval=4, save_enabled=False)
    assert no_save.check(4) == ExitDecision(
        should_exit=True,
        should_save=False,
        reason="interval",
        exit_code=0,
        message=no_save.check(4).message,
    )


def test_exit_duration_uses_elapsed_minutes() -> None:
    exits = ExitConditions(exit_duration_in_mins=1, start_time=time.time())
    assert exits.is_collective
    assert not exits.check(1).should_exit
    late = ExitConditions(exit_duration_in_mins=1, start_time=time.time() - 61.0)
    decision = late.check(3)
    assert decision.should_exit and decision.should_save and decision.reason == "duration"
    assert "exit_duration_in_mins=1" in decision.message


def test_stop_request_and_reason_priority() -> None:
    flag = _Flag()
    exits = ExitConditions(exit_interval=2, stop_requesters=[flag])
    assert exits.check(1) == ExitDecision()
    flag.value = True
    # Several conditions at once: the stop request is reported before the interval.
    assert exits.check(2).reason == "stop_request"


def test_signal_is_recorded_not_fatal_and_the_handler_is_restored() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    exits = ExitConditions.from_config(
        TrainingConfig(train_iters=5, exit_signal_handler=True, exit_signal=signal.SIGUSR1),
        save_enabled=True,
    )
    try:
        assert exits.signal_handler is not None and exits.signal_handler.installed
        assert not exits.check(1).should_exit
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)  # a second signal (e.g. during the save)
        assert exits.signal_handler.count == 2
        decision = exits.check(2, saved_this_iteration=False)
        assert (decision.should_exit, decision.should_save, decision.reason) == (
            True,
            True,
            "signal",
        )
        assert "SIGUSR1" in decision.message
    finally:
        exits.close()
    assert signal.getsignal(signal.SIGUSR1) is before
    exits.close()  # idempotent


def test_a_process_forked_from_the_trainer_neither_reports_nor_dies_of_the_signal() -> None:
    """megatron's fork-per-save checkpoint writer and data loader workers are forked from
    the trainer and inherit the handler: the signal sent to the rank's process group must
    not end them (the writer finishes what the rank commits) and must not be reported as
    the rank's (the elastic drill logged every SIGTERM twice)."""
    exits = ExitConditions.from_config(
        TrainingConfig(train_iters=5, exit_signal_handler=True, exit_signal=signal.SIGUSR2),
        save_enabled=True,
    )
    try:
        handler = exits.signal_handler
        assert handler is not None
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: wait for the signal, let the handler run, report its count
            os.close(read)
            woken_read, woken_write = os.pipe()
            os.set_blocking(woken_write, False)
            signal.set_wakeup_fd(woken_write)  # a byte per signal, before the handler runs
            os.write(write, b"x")
            select.select([woken_read], [], [], 20)
            time.sleep(0.1)  # the Python-level handler runs between these bytecodes
            os._exit(10 + handler.count)
        os.close(write)
        assert os.read(read, 1) == b"x"
        os.close(read)
        os.kill(pid, signal.SIGUSR2)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status), f"the child died of the signal: {status}"
        assert os.WEXITSTATUS(status) == 10, "the child counted the rank's signal"
        # The trainer's own process still records it.
        os.kill(os.getpid(), signal.SIGUSR2)
        assert handler.count == 1
    finally:
        exits.close()


def test_switched_off_requesters_add_no_collective() -> None:
    off = _Flag(True)
    off.enabled = False  # type: ignore[attr-defined]
    exits = ExitConditions(stop_requesters=[off])
    assert not exits.is_collective and exits.check(1) == ExitDecision()


def test_the_handler_must_be_installed_from_the_main_thread() -> None:
    errors: list[BaseException] = []

    def build() -> None:
        try:
            ExitSignalHandler(signal.SIGUSR1)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=build)
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], ResiliencyError)
    assert "only be installed from the main thread" in str(errors[0])


def test_bad_inputs_name_the_field() -> None:
    with pytest.raises(ResiliencyError, match=r"train\.exit_interval: got 0"):
        ExitConditions(exit_interval=0)
    with pytest.raises(ResiliencyError, match=r"exit_duration_in_mins: got -1"):
        ExitConditions(exit_duration_in_mins=-1)
    with pytest.raises(ResiliencyError, match="has no stop_requested"):
        ExitConditions(stop_requesters=[object()])  # type: ignore[list-item]
    with pytest.raises(ResiliencyError, match="SIGKILL; it cannot be caught"):
        ExitSignalHandler(signal.SIGKILL)
    with pytest.raises(ResiliencyError, match="exit_signal: got 12345"):
        ExitSignalHandler(12345)


def test_dataloader_guard_installs_a_recording_handler() -> None:
    calls: list[int] = []
    before = signal.getsignal(signal.SIGUSR2)
    try:
        DataloaderSignalGuard(signal.SIGUSR2, chained=calls.append)(3)
        assert calls == [3]
        os.kill(os.getpid(), signal.SIGUSR2)  # recorded, the test process survives
        handler = signal.getsignal(signal.SIGUSR2)
        assert getattr(handler, "__self__", None) is not None
        assert handler.__self__.count == 1  # type: ignore[union-attr]
    finally:
        signal.signal(signal.SIGUSR2, before)


def _agree_across_ranks(rank: int, world: int) -> list[tuple[int, str | None]]:
    # Rank 1 gets the signal at iteration 3 and started its clock earlier; every rank must
    # reach the same decisions at the same iterations.
    start = time.time() - (120.0 if rank == 1 else 0.0)
    decisions: list[tuple[int, str | None]] = []
    exits = ExitConditions(exit_signal=signal.SIGUSR1, start_time=start)
    try:
        for iteration in range(1, 4):
            if rank == 1 and iteration == 3:
                os.kill(os.getpid(), signal.SIGUSR1)
            decision = exits.check(iteration)
            decisions.append((iteration, decision.reason))
    finally:
        exits.close()
    late = ExitConditions(exit_duration_in_mins=1, start_time=start)
    decisions.append((99, late.check(99).reason))
    return decisions


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_every_rank_decides_the_same() -> None:
    results = run_distributed(_agree_across_ranks, 2, timeout=90)
    assert results[0] == results[1] == [(1, None), (2, None), (3, "signal"), (99, "duration")]
