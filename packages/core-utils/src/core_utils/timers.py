"""Named wall-clock timers with cross-rank reporting, usable on CPU and GPU.

A drop-in for megatron-core's ``megatron.core.timers.Timers``. megatron's version calls
``torch.cuda.synchronize()`` on every start/stop and gathers on the current CUDA device,
so it cannot run without a GPU. These timers synchronise CUDA only when CUDA is available
*and* already initialised (so timing never creates a CUDA context), gather on the device the
default process group's backend needs (CPU for gloo, CUDA for nccl), and also work when
``torch.distributed`` is not initialised (one rank).

Typical use::

    timers = Timers(log_level=1, log_option="minmax")
    timers("forward-backward", log_level=1).start(barrier=True)
    ...
    timers("forward-backward").stop()
    timers.log(["forward-backward"], normalizer=log_interval)
    timers.write(["forward-backward"], tb_writer, iteration, normalizer=log_interval)

Every rank must call :meth:`Timers.log`, :meth:`Timers.write`,
:meth:`Timers.get_all_timers_string` and :meth:`Timers.min_max_times` with the same names:
they are collectives over the default process group.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, Final, Literal

import torch
import torch.distributed as dist

from core_utils.distributed import collective_device, dist_ready

__all__ = ["DummyTimer", "Timer", "TimerBase", "Timers"]

LOG_OPTIONS: Final = ("max", "minmax", "all")
MAX_LOG_LEVEL: Final = 2


def _synchronize_cuda() -> None:
    # Only wait for kernels that can exist: never initialise CUDA just to time something.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class TimerBase:
    """Interface shared by :class:`Timer` and :class:`DummyTimer`."""

    def __init__(self, name: str) -> None:
        self.name = name

    def start(self, barrier: bool = False) -> None:
        """Start timing (``barrier``: synchronise the barrier group's ranks first)."""
        raise NotImplementedError

    def stop(self, barrier: bool = False) -> None:
        """Stop timing and add the interval to the elapsed time."""
        raise NotImplementedError

    def reset(self) -> None:
        """Zero the elapsed time."""
        raise NotImplementedError

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Return the elapsed seconds (see :meth:`Timer.elapsed`)."""
        raise NotImplementedError

    def active_time(self) -> float:
        """Return the seconds this timer has been running since it was created."""
        raise NotImplementedError


class DummyTimer(TimerBase):
    """Stands in for a timer whose log level is above the configured one.

    ``start``, ``stop`` and ``reset`` do nothing, so instrumented code runs unchanged;
    reading a time from it is a mistake and raises.
    """

    def __init__(self, name: str = "dummy timer") -> None:
        super().__init__(name)

    def start(self, barrier: bool = False) -> None:
        """Do nothing."""

    def stop(self, barrier: bool = False) -> None:
        """Do nothing."""

    def reset(self) -> None:
        """Do nothing."""

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Raise: a disabled timer has no time.

        Raises:
            RuntimeError: Always.
        """
        raise RuntimeError(
            f"timer {self.name!r} is disabled (its log_level is above the Timers log_level), "
            "so it has no elapsed time; raise the Timers log_level to measure it"
        )

    def active_time(self) -> float:
        """Raise: a disabled timer has no time.

        Raises:
            RuntimeError: Always.
        """
        raise RuntimeError(
            f"timer {self.name!r} is disabled (its log_level is above the Timers log_level), "
            "so it has no active time; raise the Timers log_level to measure it"
        )


class Timer(TimerBase):
    """A start/stop wall-clock timer that accumulates elapsed seconds.

    With ``barrier=True`` every rank of the barrier group (the default group unless
    :meth:`set_barrier_group` was called) waits for the others first; all of them must
    then call the same method or they hang.
    """

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._elapsed = 0.0
        self._active_time = 0.0
        self._started = False
        self._barrier_group: dist.ProcessGroup | None = None
        self._start_time = time.perf_counter()

    def set_barrier_group(self, barrier_group: dist.ProcessGroup | None) -> None:
        """Use ``barrier_group`` (``None``: the default group) for ``barrier=True``."""
        self._barrier_group = barrier_group

    def _barrier(self) -> None:
        if dist_ready():
            dist.barrier(group=self._barrier_group)

    def start(self, barrier: bool = False) -> None:
        """Start timing.

        Raises:
            RuntimeError: The timer is already running.
        """
        if self._started:
            raise RuntimeError(f"timer {self.name!r} has already been started; stop it first")
        if barrier:
            self._barrier()
        _synchronize_cuda()
        self._start_time = time.perf_counter()
        self._started = True

    def stop(self, barrier: bool = False) -> None:
        """Stop timing and add the interval to the elapsed time.

        Raises:
            RuntimeError: The timer is not running.
        """
        if not self._started:
            raise RuntimeError(f"timer {self.name!r} is not started; call start() first")
        if barrier:
            self._barrier()
        _synchronize_cuda()
        interval = time.perf_counter() - self._start_time
        self._elapsed += interval
        self._active_time += interval
        self._started = False

    def reset(self) -> None:
        """Zero the elapsed time and mark the timer stopped (active time is kept)."""
        self._elapsed = 0.0
        self._started = False

    def set_elapsed(self, value: float) -> None:
        """Set the elapsed seconds directly (e.g. a start-up time measured elsewhere)."""
        self._elapsed = float(value)

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Return the elapsed seconds; a running timer keeps running.

        Args:
            reset: Zero the elapsed time after reading it.
            barrier: Synchronise ranks around the stop/restart of a running timer.

        Returns:
            Seconds accumulated since the last reset, including the current interval.
        """
        running = self._started
        if running:
            self.stop(barrier=barrier)
        value = self._elapsed
        if reset:
            self.reset()
        if running:
            self.start(barrier=barrier)
        return value

    def active_time(self) -> float:
        """Return the total seconds this timer has run; :meth:`reset` does not clear it."""
        return self._active_time


class Timers:
    """A group of named timers with a log level and cross-rank reporting.

    Args:
        log_level: Timers created with a level above this (0, 1 or 2) are disabled
            (:class:`DummyTimer`).
        log_option: How times are combined across ranks when logged: ``"max"`` (the
            slowest rank), ``"minmax"`` (fastest and slowest) or ``"all"`` (every rank).

    Raises:
        ValueError: ``log_option`` or ``log_level`` is not one of the allowed values.
    """

    def __init__(self, log_level: int, log_option: str) -> None:
        if isinstance(log_level, bool) or not isinstance(log_level, int):
            raise ValueError(f"log_level must be an int in 0..{MAX_LOG_LEVEL}, got {log_level!r}")
        if not 0 <= log_level <= MAX_LOG_LEVEL:
            raise ValueError(f"log_level must be in 0..{MAX_LOG_LEVEL}, got {log_level}")
        if log_option not in LOG_OPTIONS:
            raise ValueError(f"log_option must be one of {LOG_OPTIONS}, got {log_option!r}")
        self._log_level = log_level
        self._log_option: Literal["max", "minmax", "all"] = log_option  # type: ignore[assignment]
        self._max_log_level = MAX_LOG_LEVEL
        self._timers: dict[str, Timer] = {}
        self._log_levels: dict[str, int] = {}
        self._dummy_timers: dict[str, DummyTimer] = {}

    def __call__(self, name: str, log_level: int | None = None) -> TimerBase:
        """Return the timer called ``name``, creating it on first use.

        Args:
            name: Timer name.
            log_level: Level of the timer (default 2, the most detailed). A timer above the
                group's log level is a no-op :class:`DummyTimer`.

        Returns:
            The timer (the same object on every call with this name).

        Raises:
            ValueError: ``log_level`` differs from the level the timer was created with,
                or exceeds the maximum level 2.
        """
        if name in self._timers:
            if log_level is not None and log_level != self._log_levels[name]:
                raise ValueError(
                    f"timer {name!r} was created with log_level={self._log_levels[name]}, "
                    f"got log_level={log_level}; use the same level or a new name"
                )
            return self._timers[name]
        level = self._max_log_level if log_level is None else log_level
        if level > self._max_log_level:
            raise ValueError(
                f"log_level={level} for timer {name!r} exceeds the maximum {self._max_log_level}"
            )
        if level > self._log_level:
            return self._dummy_timers.setdefault(name, DummyTimer(name))
        timer = Timer(name)
        self._timers[name] = timer
        self._log_levels[name] = level
        return timer

    @property
    def log_level(self) -> int:
        """The configured log level."""
        return self._log_level

    @property
    def log_option(self) -> str:
        """The configured cross-rank log option."""
        return self._log_option

    def _names(self, names: Iterable[str] | None) -> list[str]:
        if names is None:
            return list(self._timers)
        if isinstance(names, str):
            raise TypeError(f"names must be a list of timer names, got the string {names!r}")
        return list(names)

    def _elapsed_all_ranks(self, names: list[str], reset: bool, barrier: bool) -> torch.Tensor:
        """Gather elapsed seconds: a ``[world_size, len(names)]`` tensor on CPU.

        A timer that does not exist (or is disabled) on a rank reads 0 on that rank.
        """
        if barrier and dist_ready():
            dist.barrier()
        local = torch.zeros(len(names), dtype=torch.float64)
        for i, name in enumerate(names):
            if name in self._timers:
                # Every rank is already synchronised here; no per-timer barrier needed.
                local[i] = self._timers[name].elapsed(reset=reset)
        if not dist_ready() or dist.get_world_size() == 1:
            return local.unsqueeze(0)
        device = collective_device()
        local = local.to(device)
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        return torch.stack(gathered).cpu()

    def min_max_times(
        self,
        names: Iterable[str] | None = None,
        normalizer: float = 1.0,
        reset: bool = True,
        barrier: bool = False,
    ) -> dict[str, tuple[float, float]]:
        """Return ``{name: (min, max)}`` seconds across ranks, divided by ``normalizer``.

        Ranks on which a timer measured nothing are ignored; timers that measured nothing
        on any rank are left out. A collective: every rank must call it with the same names.

        Raises:
            ValueError: ``normalizer`` is not positive.
        """
        if not normalizer > 0.0:
            raise ValueError(f"normalizer must be > 0, got {normalizer}")
        name_list = self._names(names)
        if not name_list:
            return {}
        times = self._elapsed_all_ranks(name_list, reset, barrier)
        result: dict[str, tuple[float, float]] = {}
        for i, name in enumerate(name_list):
            measured = [t for t in times[:, i].tolist() if t > 0.0]
            if measured:
                result[name] = (min(measured) / normalizer, max(measured) / normalizer)
        return result

    def get_all_timers_string(
        self,
        names: Iterable[str] | None = None,
        normalizer: float = 1.0,
        reset: bool = True,
        barrier: bool = False,
    ) -> str | None:
        """Format the timers' times in milliseconds according to the log option.

        Args:
            names: Timers to report; ``None`` means every timer created on this rank.
            normalizer: Divide times by this (e.g. the number of iterations timed).
            reset: Zero the timers after reading them.
            barrier: Synchronise ranks before reading.

        Returns:
            The report, or ``None`` when no named timer measured anything.

        Raises:
            ValueError: ``normalizer`` is not positive.
        """
        if not normalizer > 0.0:
            raise ValueError(f"normalizer must be > 0, got {normalizer}")
        name_list = self._names(names)
        if self._log_option == "all":
            return self._all_ranks_string(name_list, normalizer, reset, barrier)
        min_max = self.min_max_times(name_list, normalizer / 1000.0, reset, barrier)
        if not min_max:
            return None
        if self._log_option == "max":
            lines = ["max time across ranks (ms):"]
            lines += [f"    {(n + ' ').ljust(48, '.')}: {mx:.2f}" for n, (_, mx) in min_max.items()]
        else:
            lines = ["(min, max) time across ranks (ms):"]
            lines += [
                f"    {(n + ' ').ljust(48, '.')}: ({mn:.2f}, {mx:.2f})"
                for n, (mn, mx) in min_max.items()
            ]
        return "\n".join(lines)

    def _all_ranks_string(
        self, names: list[str], normalizer: float, reset: bool, barrier: bool
    ) -> str | None:
        if not names:
            return None
        times = self._elapsed_all_ranks(names, reset, barrier) * (1000.0 / normalizer)
        lines = ["times across ranks (ms):"]
        for i, name in enumerate(names):
            per_rank = [(r, t) for r, t in enumerate(times[:, i].tolist()) if t > 0.0]
            if per_rank:
                lines.append(f"  {name}:")
                lines += [f"     rank {r:2d}: {t:.2f}" for r, t in per_rank]
        return "\n".join(lines) if len(lines) > 1 else None

    def log(
        self,
        names: Iterable[str] | None,
        rank: int | None = None,
        normalizer: float = 1.0,
        reset: bool = True,
        barrier: bool = False,
    ) -> str | None:
        """Print the timers' report (see :meth:`get_all_timers_string`) on one rank.

        A collective: every rank must call it with the same names.

        Args:
            names: Timers to report (``None``: every timer created on this rank).
            rank: Rank that prints; ``None`` means the last rank.
            normalizer: Divide times by this (e.g. the log interval).
            reset: Zero the timers after reading them.
            barrier: Synchronise ranks before reading.

        Returns:
            The printed report on the printing rank, ``None`` elsewhere or when empty.
        """
        report = self.get_all_timers_string(names, normalizer, reset, barrier)
        world_size = dist.get_world_size() if dist_ready() else 1
        my_rank = dist.get_rank() if dist_ready() else 0
        target = world_size - 1 if rank is None else rank
        if target != my_rank or report is None:
            return None
        print(report, flush=True)
        return report

    def write(
        self,
        names: Iterable[str] | None,
        writer: Any,
        iteration: int,
        normalizer: float = 1.0,
        reset: bool = True,
        barrier: bool = False,
    ) -> None:
        """Write each timer's maximum time across ranks (seconds) to ``writer``.

        The tag is ``"<name>-time"``. ``writer`` is a TensorBoard-like object with
        ``add_scalar(tag, value, step)``, a wandb-like object with ``log(dict, step)``, or
        ``None`` (the ranks without a writer still take part in the collective).

        Raises:
            ValueError: ``normalizer`` is not positive.
            TypeError: ``writer`` has neither ``add_scalar`` nor ``log``.
        """
        min_max = self.min_max_times(names, normalizer, reset, barrier)
        if writer is None:
            return
        for name, (_, max_time) in min_max.items():
            tag = f"{name}-time"
            if hasattr(writer, "add_scalar"):
                writer.add_scalar(tag, max_time, iteration)
            elif hasattr(writer, "log"):
                writer.log({tag: max_time}, iteration)
            else:
                raise TypeError(
                    f"writer {type(writer).__name__} has neither add_scalar(tag, value, step) "
                    "nor log(dict, step)"
                )
