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

from bridge.resiliency.errors import ResiliencyError
from core_utils.distributed import global_rank

__all__ = ["HangWatchdog", "WatchdogTimeouts"]

logger = logging.getLogger(__name__)

_PROCESS_SCRIPT = Path(__file__).with_name("_watchdog_process.py")


_PHASES = ("step", "setup", "checkpointing", "out_of_section")


@dataclass(frozen=True)
class WatchdogTimeouts:
    """How long each phase of a training job may run before its rank counts as hung.

    ``None`` switches detection off for that phase. The first training step and the first
    evaluation step (the warm-up steps, which compile, allocate and build caches) run under
    the ``setup`` timeout, not the ``step`` one, like nvidia-resiliency-ext's rank monitor
    keeps them out of its ``step`` section; with ``setup=None`` they are not timed at all.

    Build one from a command-line value with :meth:`parse`
    (``"step:60,setup:900,checkpointing:600"``); ``str()`` gives that form back.

    Attributes:
        step: Seconds one training or evaluation step may take.
        setup: Seconds from :meth:`HangWatchdog.start` to the end of setup (model build,
            checkpoint load), and, counted afresh, seconds the warm-up step may take;
            ``None``: unlimited.
        checkpointing: Seconds one checkpoint save, or one wait for an asynchronous save
            to finish, may take; ``None``: unlimited.
        out_of_section: Seconds the loop may spend between steps (logging, exit checks,
            evaluation set-up); ``None``: the ``step`` timeout.
    """

    step: float
    setup: float | None = None
    checkpointing: float | None = None
    out_of_section: float | None = None

    def __post_init__(self) -> None:
        for name in _PHASES:
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ResiliencyError(
                    f"WatchdogTimeouts.{name}: got {value!r}; expected a number of seconds "
                    "> 0" + ("" if name == "step" else " or None to switch it off")
                )

    @classmethod
    def parse(cls, text: str) -> WatchdogTimeouts:
        """Read timeouts written as on a command line.

        Accepted forms: a number of seconds (the ``step`` timeout, every other phase at its
        default), or comma-separated ``phase:seconds`` pairs with the phases ``step``
        (required), ``setup``, ``checkpointing`` and ``out_of_section``, where ``none``
        switches a phase off: ``"step:60,setup:900,checkpointing:600"``.

        Args:
            text: The value to read.

        Returns:
            The timeouts.

        Raises:
            ResiliencyError: An unknown phase, a repeated phase, a value that is not a
                positive number, or no ``step`` timeout (the message names the bad part).
        """
        spec = text.strip()
        hint = (
            "write seconds for the step timeout (e.g. '60') or phase:seconds pairs "
            "(e.g. 'step:60,setup:900,checkpointing:600,out_of_section:60'; 'none' "
            "switches a phase off)"
        )
        if ":" not in spec:
            return cls(step=_seconds(spec, "step", text, hint))
        values: dict[str, float | None] = {}
        for part in spec.split(","):
            phase, sep, value = part.strip().partition(":")
            phase = phase.strip()
            if not sep or phase not in _PHASES:
                raise ResiliencyError(
                    f"hang timeouts {text!r}: {part.strip()!r} is not phase:seconds with a "
                    f"phase among {', '.join(_PHASES)}; {hint}"
                )
            if phase in values:
                raise ResiliencyError(f"hang timeouts {text!r}: phase {phase!r} given twice")
            values[phase] = (
                None if value.strip().lower() == "none" else _seconds(value, phase, text, hint)
            )
        step = values.pop("step", None)
        if step is None:
            raise ResiliencyError(
                f"hang timeouts {text!r}: a step timeout in seconds is required; {hint}"
            )
        return cls(step=step, **values)

    def __str__(self) -> str:
        """The :meth:`parse` form, e.g. ``step:60,setup:900,checkpointing:none,...``."""
        return ",".join(f"{name}:{_format_seconds(getattr(self, name))}" for name in _PHASES)

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


def _format_seconds(value: float | None) -> str:
    if value is None:
        return "none"
    return str(int(value)) if value.is_integer() else repr(value)


def _seconds(value: str, phase: str, text: str, hint: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise ResiliencyError(
            f"hang timeouts {text!r}: {phase} got {value.strip()!r}, not a number of seconds "
            f"> 0; {hint}"
        )
    return seconds


class HangWatchdog:
    """Kill this rank when it stops making progress, so an elastic launcher can restart it.

    Use::

        watchdog = HangWatchdog(WatchdogTimeouts(step=60.0, setup=900.0, checkpointing=600.0))
        watchdog.start()                        # arms the setup phase
        watchdog.enter("step", warmup=True)     # before the first step: the setup timeout
        watchdog.enter("out_of_section")        # after each step
        watchdog.enter("step")                  # before each later step
        watchdog.stop()                         # at the end (also on exceptions)

    :class:`~bridge.resiliency.FaultTolerance` makes these calls from its hooks, warm-up
    rule included.

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
        self.rank = global_rank(launcher_fallback=True) if rank is None else rank
        self.kill_signal = signal.Signals(kill_signal)
        self._process: subprocess.Popen[bytes] | None = None
        self._broken = False
        self.phase: str | None = None
        self.warmup = False

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

    def timeout_of(self, phase: str, *, warmup: bool = False) -> float | None:
        """The timeout :meth:`enter` arms for ``phase`` (``None``: not timed).

        Raises:
            ResiliencyError: An unknown phase, or ``warmup`` with a phase other than
                ``"step"``.
        """
        if warmup:
            if phase != "step":
                raise ResiliencyError(
                    f"HangWatchdog.enter: warmup applies to the 'step' phase, not {phase!r}"
                )
            return self.timeouts.setup
        return self.timeouts.for_phase(phase)

    def enter(self, phase: str, *, warmup: bool = False) -> None:
        """Tell the watchdog this rank enters ``phase``; its timeout starts now.

        Args:
            phase: ``"setup"``, ``"step"``, ``"checkpointing"`` or ``"out_of_section"``.
            warmup: This step is a warm-up step (the first training or evaluation step):
                it runs under the ``setup`` timeout instead of the ``step`` one.
        """
        timeout = self.timeout_of(phase, warmup=warmup)
        self.phase, self.warmup = phase, warmup
        label = f"{phase} (warm-up)" if warmup else phase
        self._send(b"DISARM\n" if timeout is None else f"ARM {timeout} {label}\n".encode())

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
