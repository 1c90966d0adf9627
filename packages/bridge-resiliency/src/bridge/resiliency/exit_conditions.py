"""When should training stop early, and must it save first? One decision per iteration.

The training loop calls :meth:`ExitConditions.check` after every step on every rank and
acts on the :class:`ExitDecision` it returns::

    exits = ExitConditions.from_config(cfg.train, save_enabled=cfg.checkpoint.save is not None)
    ...
    decision = exits.check(iteration, saved_this_iteration=saved)
    if decision.should_save:
        save_checkpoint(...)
    if decision.should_exit:
        break
    ...
    exits.close()
    sys.exit(decision.exit_code)

Conditions (all optional, from ``TrainingConfig`` unless noted):

* ``exit_signal_handler``: some rank received ``exit_signal`` (see
  :class:`~bridge.resiliency.ExitSignalHandler`).
* a stop request, e.g. :class:`~bridge.resiliency.NVRxStragglerMonitor` with
  ``stop_if_detected``.
* ``exit_duration_in_mins``: the run has lasted that long on the slowest-clocked rank
  (elapsed time is MAX-reduced so every rank decides the same).
* ``exit_interval``: the iteration number is a multiple of it.

Every rank gets the same decision at the same iteration: the cross-rank facts (signal,
stop request, elapsed time) travel in one all-reduce per call, made only when one of those
conditions is configured.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from bridge.config import TrainingConfig
from bridge.resiliency._dist import all_reduce_max
from bridge.resiliency.errors import ResiliencyError
from bridge.resiliency.exit_signal import ExitSignalHandler

__all__ = ["EXIT_CODE_CLEAN", "ExitConditions", "ExitDecision", "ExitReason", "StopRequester"]

ExitReason = Literal["signal", "stop_request", "duration", "interval"]

EXIT_CODE_CLEAN = 0
"""Exit code of every early stop decided here: the job ended on purpose and can resume."""


@dataclass(frozen=True)
class ExitDecision:
    """What the loop must do after this iteration.

    Attributes:
        should_exit: Leave the training loop now.
        should_save: Save a checkpoint before leaving (checkpointing is configured and the
            loop did not already save at this iteration).
        reason: Why (``None`` when training continues). When several conditions hold at
            once the first of ``signal``, ``stop_request``, ``duration``, ``interval`` is
            reported.
        exit_code: The process exit code to use after leaving the loop.
        message: A human-readable explanation for the log.
    """

    should_exit: bool = False
    should_save: bool = False
    reason: ExitReason | None = None
    exit_code: int = EXIT_CODE_CLEAN
    message: str = ""


CONTINUE = ExitDecision()


@runtime_checkable
class StopRequester(Protocol):
    """Anything that can ask the loop to stop cleanly (checked on every rank).

    A requester with an ``enabled`` attribute that is False is ignored by
    :class:`ExitConditions`.
    """

    def stop_requested(self) -> bool:
        """Whether this rank wants the job to stop (any rank is enough)."""
        ...


class ExitConditions:
    """The early-exit conditions of one training run.

    Args:
        exit_interval: Stop when ``iteration % exit_interval == 0``.
        exit_duration_in_mins: Stop once this many minutes passed since ``start_time``.
        exit_signal: Install an :class:`ExitSignalHandler` for this signal (``None``: no
            handler). Installing must happen in the main thread.
        save_enabled: Whether the run saves checkpoints (``checkpoint.save`` is set); without
            it decisions never ask for a save.
        start_time: ``time.time()`` at which the run started (default: now).
        stop_requesters: Objects whose :meth:`StopRequester.stop_requested` can end the run.

    Raises:
        ResiliencyError: A non-positive interval or duration, or a bad signal.
    """

    def __init__(
        self,
        *,
        exit_interval: int | None = None,
        exit_duration_in_mins: float | None = None,
        exit_signal: int | None = None,
        save_enabled: bool = True,
        start_time: float | None = None,
        stop_requesters: Sequence[StopRequester] = (),
    ) -> None:
        for name, value in (
            ("exit_interval", exit_interval),
            ("exit_duration_in_mins", exit_duration_in_mins),
        ):
            if value is not None and not value > 0:
                raise ResiliencyError(
                    f"train.{name}: got {value!r}; expected a positive number or None (off)"
                )
        for requester in stop_requesters:
            if not isinstance(requester, StopRequester):
                raise ResiliencyError(
                    f"ExitConditions.stop_requesters: {requester!r} has no stop_requested() method"
                )
        self.exit_interval = exit_interval
        self.exit_duration_in_mins = exit_duration_in_mins
        self.save_enabled = save_enabled
        self.start_time = time.time() if start_time is None else start_time
        # A requester that says it is switched off (``enabled = False``, e.g. an NVRx
        # straggler monitor of a disabled section) would only add a collective per step.
        self.stop_requesters = tuple(r for r in stop_requesters if getattr(r, "enabled", True))
        self.signal_handler = ExitSignalHandler(exit_signal) if exit_signal is not None else None
        self.last_decision: ExitDecision = CONTINUE

    @classmethod
    def from_config(
        cls,
        train: TrainingConfig,
        *,
        save_enabled: bool,
        start_time: float | None = None,
        stop_requesters: Sequence[StopRequester] = (),
    ) -> ExitConditions:
        """Build the conditions of ``train`` (installs the signal handler if configured).

        Args:
            train: The ``train`` section: ``exit_interval``, ``exit_duration_in_mins``,
                ``exit_signal_handler`` and ``exit_signal`` are used.
            save_enabled: Whether checkpoints are saved (``checkpoint.save is not None``).
            start_time: ``time.time()`` at which the run started (default: now).
            stop_requesters: Extra stop sources, e.g. an NVRx straggler monitor.

        Returns:
            The conditions; call :meth:`check` after every step and :meth:`close` at the end.
        """
        return cls(
            exit_interval=train.exit_interval,
            exit_duration_in_mins=train.exit_duration_in_mins,
            exit_signal=train.exit_signal if train.exit_signal_handler else None,
            save_enabled=save_enabled,
            start_time=start_time,
            stop_requesters=stop_requesters,
        )

    @property
    def is_collective(self) -> bool:
        """Whether :meth:`check` makes an all-reduce (every rank must call it in step)."""
        return bool(
            self.signal_handler is not None
            or self.stop_requesters
            or self.exit_duration_in_mins is not None
        )

    def elapsed_minutes(self) -> float:
        """Minutes since ``start_time`` on this rank."""
        return (time.time() - self.start_time) / 60.0

    def check(self, iteration: int, *, saved_this_iteration: bool = False) -> ExitDecision:
        """Decide whether to stop after ``iteration`` (the number of completed steps).

        A collective when :attr:`is_collective`: call it on every rank after every step.

        Args:
            iteration: Iterations completed so far (after this step).
            saved_this_iteration: The loop already saved a checkpoint at this iteration
                (e.g. its regular ``save_interval``), so an exit needs no second save.

        Returns:
            The decision, identical on every rank.
        """
        signal_flag, elapsed, stop_flag = 0.0, 0.0, 0.0
        if self.is_collective:
            local = [
                1.0 if self.signal_handler is not None and self.signal_handler.received else 0.0,
                self.elapsed_minutes() if self.exit_duration_in_mins is not None else 0.0,
                1.0 if any(r.stop_requested() for r in self.stop_requesters) else 0.0,
            ]
            signal_flag, elapsed, stop_flag = all_reduce_max(local)
        reason: ExitReason | None = None
        message = ""
        if signal_flag > 0.0:
            assert self.signal_handler is not None
            reason = "signal"
            message = f"a rank received {self.signal_handler.signal.name}"
        elif stop_flag > 0.0:
            reason = "stop_request"
            message = "a rank requested a stop (e.g. stragglers detected)"
        elif self.exit_duration_in_mins is not None and elapsed > self.exit_duration_in_mins:
            reason = "duration"
            message = (
                f"the run lasted {elapsed:.2f} min > exit_duration_in_mins="
                f"{self.exit_duration_in_mins}"
            )
        elif self.exit_interval is not None and iteration % self.exit_interval == 0:
            reason = "interval"
            message = f"iteration {iteration} is a multiple of exit_interval={self.exit_interval}"
        if reason is None:
            decision = CONTINUE
        else:
            decision = ExitDecision(
                should_exit=True,
                should_save=self.save_enabled and not saved_this_iteration,
                reason=reason,
                exit_code=EXIT_CODE_CLEAN,
                message=f"exiting after iteration {iteration}: {message}",
            )
        self.last_decision = decision
        return decision

    def close(self) -> None:
        """Restore the previous signal handler (idempotent).

        Call it after the final checkpoint is written: until then a repeated signal is
        ignored rather than killing the process mid-save.
        """
        if self.signal_handler is not None:
            self.signal_handler.release()

    def __enter__(self) -> ExitConditions:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
