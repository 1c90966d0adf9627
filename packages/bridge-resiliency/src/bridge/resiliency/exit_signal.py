"""Turn a termination signal into a clean "save a checkpoint, then exit 0".

Schedulers (SLURM, Kubernetes, ``torchrun`` itself) announce the end of a job with a
signal, usually ``SIGTERM``, some seconds before they kill it. :class:`ExitSignalHandler`
replaces the signal's default action (die at once) with "remember it": the training loop
asks at the end of each step whether *any* rank received it
(:meth:`ExitSignalHandler.signals_received`, an all-reduce), so every rank stops at the same
iteration, saves one checkpoint together and exits with code 0.

Signals that arrive while the checkpoint is being written are only counted: the handler
never raises and never exits, so the save always completes and the tracker file that marks
it complete is written last. After :meth:`ExitSignalHandler.release` the previous handler
is back (by default: die on the signal).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType
from typing import Any

from bridge.resiliency._dist import all_reduce_max
from bridge.resiliency.errors import ResiliencyError
from core_utils.distributed import global_rank

__all__ = ["DataloaderSignalGuard", "ExitSignalHandler"]

logger = logging.getLogger(__name__)

_Handler = Any  # what signal.signal accepts and returns: a callable, SIG_DFL, SIG_IGN or None


def _as_signal(value: int | signal.Signals, owner: str) -> signal.Signals:
    try:
        return signal.Signals(value)
    except ValueError:
        raise ResiliencyError(
            f"{owner}: got {value!r}; expected a signal number such as 15 (SIGTERM) or 10 (SIGUSR1)"
        ) from None


class ExitSignalHandler:
    """Record a termination signal instead of dying of it; report it across ranks.

    Args:
        sig: The signal to catch (``TrainingConfig.exit_signal``; SIGTERM by default).
        install: Install the handler now (must be called from the main thread).

    Raises:
        ResiliencyError: ``sig`` cannot be caught (SIGKILL, SIGSTOP) or is not a signal, or
            the handler is installed from a thread other than the main thread.
    """

    def __init__(self, sig: int | signal.Signals = signal.SIGTERM, *, install: bool = True) -> None:
        self.signal = _as_signal(sig, "exit_signal")
        if self.signal in (signal.SIGKILL, signal.SIGSTOP):
            raise ResiliencyError(
                f"exit_signal: got {self.signal.name}; it cannot be caught. Use SIGTERM "
                "(default), SIGINT or SIGUSR1/SIGUSR2."
            )
        self.count = 0
        self._previous: _Handler = None
        self._pid = os.getpid()
        self._installed = False
        if install:
            self.install()

    @property
    def received(self) -> bool:
        """Whether this process received the signal since it was installed."""
        return self.count > 0

    @property
    def installed(self) -> bool:
        """Whether the handler is currently installed."""
        return self._installed

    def install(self) -> None:
        """Install the handler (idempotent).

        Raises:
            ResiliencyError: Called from a thread other than the main thread.
        """
        if self._installed:
            return
        if threading.current_thread() is not threading.main_thread():
            raise ResiliencyError(
                "ExitSignalHandler.install: signal handlers can only be installed from the "
                "main thread; build the handler (or ExitConditions) in the main thread"
            )
        self._previous = signal.signal(self.signal, self._handle)
        self._pid = os.getpid()
        self._installed = True

    def release(self) -> None:
        """Restore the handler that was installed before (idempotent)."""
        if not self._installed:
            return
        signal.signal(self.signal, self._previous)
        self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # A process forked from the trainer (megatron's fork-per-save checkpoint writer, a
        # data loader worker) inherits this handler. It must not report the rank's signal
        # (the elastic drill's logs showed each SIGTERM twice, once from such a child), and
        # it must not die either: the writer finishes the checkpoint the rank commits, the
        # worker serves the batches the rank needs to reach its save (what
        # DataloaderSignalGuard makes explicit). The rank ends them when it exits.
        if os.getpid() != self._pid:
            return
        # Runs in the main thread between two bytecodes: only count, never raise, so a
        # checkpoint being written when the signal arrives is completed.
        self.count += 1
        if self.count == 1:
            logger.warning(
                "rank %d (pid %d) received %s: the job will save a checkpoint and exit after "
                "the current step",
                global_rank(launcher_fallback=True),
                os.getpid(),
                self.signal.name,
            )
        else:
            logger.warning(
                "rank %d received %s again (%d times); already saving and exiting, ignored",
                global_rank(launcher_fallback=True),
                self.signal.name,
                self.count,
            )

    def signals_received(self) -> bool:
        """Whether any rank received the signal (a collective over the default group).

        Every rank must call it at the same point of the loop.
        """
        (flag,) = all_reduce_max([1.0 if self.received else 0.0])
        return flag > 0.0

    def __enter__(self) -> ExitSignalHandler:
        self.install()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class DataloaderSignalGuard:
    """``worker_init_fn`` that makes DataLoader workers survive the exit signal.

    Workers are in the rank's process group and receive the same signal; dying of it would
    make the next ``next(data_iterator)`` fail before the checkpoint is written. With this
    guard (``TrainingConfig.exit_signal_handler_for_dataloader``) a worker records the
    signal and keeps serving batches until the main process shuts it down.

    Args:
        sig: The exit signal.
        chained: An existing ``worker_init_fn`` to call after installing the guard.
    """

    def __init__(self, sig: int | signal.Signals = signal.SIGTERM, chained: Any = None) -> None:
        self.signal = _as_signal(sig, "exit_signal")
        self.chained = chained

    def __call__(self, worker_id: int) -> None:
        """Install the handler in the worker, then run the chained ``worker_init_fn``."""
        ExitSignalHandler(self.signal, install=True)
        if self.chained is not None:
            self.chained(worker_id)
