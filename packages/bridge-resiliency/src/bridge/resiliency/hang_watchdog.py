"""Built-in hang detection without nvidia-resiliency-ext.

A hung rank (deadlocked, stuck in a collective whose peer died, or stopped) cannot detect
its own hang: every thread in it may be blocked. :class:`HangWatchdog` therefore starts a
small separate process (stdlib only, no torch) per rank. The rank tells it, through a pipe,
which phase it enters and so how long the next message may take; when a deadline passes,
the watchdog kills the rank with ``SIGKILL`` and the launcher (``torchrun --max-restarts``)
restarts the job from its last checkpoint, like nvidia-resiliency-ext's rank monitor does
under ``ft_launcher``.

Each message is one ``write`` to a pipe (10 to 20 microseconds measured on a loaded 2-core
machine), negligible next to a training step.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bridge.resiliency._dist import current_rank
from bridge.resiliency.errors import ResiliencyError

__all__ = ["HangWatchdog", "WatchdogTimeouts"]

logger = logging.getLogger(__name__)

_PROCESS_SCRIPT = Path(__file__).with_name("_watchdog_process.py")


@dataclass(frozen=True)
class WatchdogTimeouts:
    """How long each phase of a training job may run before its rank counts as hung.

    ``None`` switches detection off for that phase.

    Attributes:
        step: Seconds one training or evaluation step may take.
        setup: Seconds from :meth:`HangWatchdog.start` to the end of setup (model build,
            checkpoint load); ``None``: unlimited.
        checkpointing: Seconds one checkpoint save may take; ``None``: unlimited.
        out_of_section: Seconds the loop may spend between steps (logging, exit checks);
            ``None``: the ``step`` timeout.
    """

    step: float
    setup: float | None = None
    checkpointing: float | None = None
    out_of_section: float | None = None

    def __post_init__(self) -> None:
        for name in ("step", "setup", "checkpointing", "out_of_section"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ResiliencyError(
                    f"WatchdogTimeouts.{name}: got {value!r}; expected a number of seconds "
                    "> 0" + ("" if name == "step" else " or None to switch it off")
                )

    def for_phase(self, phase: str) -> float | None:
        """Timeout of ``phase`` (``setup``, ``step``, ``checkpointing``, ``out_of_section``)."""
        if phase == "out_of_section":
            return self.step if self.out_of_section is None else self.out_of_section
        if phase not in ("setup", "step", "checkpointing"):
            raise ResiliencyError(
                f"HangWatchdog phase: got {phase!r}; expected 'setup', 'step', "
                "'checkpointing' or 'out_of_section'"
            )
        value: float | None = getattr(self, phase)
        return value


class HangWatchdog:
    """Kill this rank when it stops making progress, so an elastic launcher can restart it.

    Use::

        watchdog = HangWatchdog(WatchdogTimeouts(step=60.0, checkpointing=600.0))
        watchdog.start()            # arms the setup phase
        watchdog.enter("step")      # before each step
        watchdog.enter("out_of_section")  # after each step
        watchdog.stop()             # at the end (also on exceptions)

    Args:
        timeouts: Timeout per phase.
        rank: Global rank, used in messages (default: torch.distributed's, else ``$RANK``).
        kill_signal: Signal sent to a hung rank. ``SIGKILL`` works on stopped processes
            too; it is what nvidia-resiliency-ext's rank monitor sends by default.
    """

    def __init__(
        self,
        timeouts: WatchdogTimeouts,
        *,
        rank: int | None = None,
        kill_signal: signal.Signals = signal.SIGKILL,
    ) -> None:
        self.timeouts = timeouts
        self.rank = current_rank() if rank is None else rank
        self.kill_signal = signal.Signals(kill_signal)
        self._process: subprocess.Popen[bytes] | None = None
        self._broken = False
        self.phase: str | None = None

    @property
    def running(self) -> bool:
        """Whether the watchdog process is alive."""
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start the watchdog process and arm the ``setup`` phase.

        Raises:
            ResiliencyError: The watchdog was already started.
        """
        if self._process is not None:
            raise ResiliencyError("HangWatchdog.start: the watchdog is already running")
        self._process = subprocess.Popen(
            [
                sys.executable,
                "-I",
                "-S",
                str(_PROCESS_SCRIPT),
                str(os.getpid()),
                str(self.rank),
                str(int(self.kill_signal)),
            ],
            stdin=subprocess.PIPE,
            close_fds=True,
        )
        # Forked children (DataLoader workers) must not keep the pipe open after this
        # process dies; the watchdog also exits when its parent changes.
        assert self._process.stdin is not None
        os.set_inheritable(self._process.stdin.fileno(), False)
        self.enter("setup")

    def enter(self, phase: str) -> None:
        """Tell the watchdog this rank enters ``phase``; its timeout starts now.

        Args:
            phase: ``"setup"``, ``"step"``, ``"checkpointing"`` or ``"out_of_section"``.
        """
        timeout = self.timeouts.for_phase(phase)
        self.phase = phase
        self._send(b"DISARM\n" if timeout is None else f"ARM {timeout} {phase}\n".encode())

    def stop(self) -> None:
        """Stop the watchdog process (idempotent)."""
        process, self._process = self._process, None
        if process is None:
            return
        self._send_to(process, b"STOP\n")
        try:
            if process.stdin is not None:
                process.stdin.close()
        except OSError:
            pass
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)

    def _send(self, message: bytes) -> None:
        if self._process is not None:
            self._send_to(self._process, message)

    def _send_to(self, process: subprocess.Popen[bytes], message: bytes) -> None:
        if self._broken or process.stdin is None:
            return
        try:
            os.write(process.stdin.fileno(), message)
        except OSError as exc:  # the watchdog died (e.g. killed with the process group)
            self._broken = True
            logger.warning(
                "HangWatchdog of rank %d is gone (%s); hang detection is off", self.rank, exc
            )

    def __enter__(self) -> HangWatchdog:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
