"""A progress display for a person watching training: a live bar on a terminal, lines otherwise."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Self

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from bridge.logging._dist import is_last_rank

__all__ = ["ProgressReporter", "format_duration"]


def format_duration(seconds: float) -> str:
    """``seconds`` as ``H:MM:SS`` (``D days, H:MM:SS`` past a day)."""
    seconds = max(0, round(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    clock = f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{days} day{'s' if days != 1 else ''}, {clock}" if days else clock


def _format_metrics(metrics: Mapping[str, float]) -> str:
    return " | ".join(f"{name}: {value:.4g}" for name, value in metrics.items())


class ProgressReporter:
    """Training progress with elapsed time and an ETA.

    On an interactive terminal it draws a live bar with rich (console lines printed
    meanwhile, such as ``training_log``'s, scroll above it). Otherwise (CI, SLURM logs,
    a pipe) it prints one plain line every ``plain_interval`` iterations and at the end::

        [training] 50/200 (25.0%) | elapsed 0:01:02 | ETA 0:03:06 | 0.81 it/s | lm loss: 2.31

    The ETA assumes the remaining iterations run at the average rate of this job so far.

    Args:
        total: Iterations the run trains for (``train_iters``).
        start: Iterations already done when this job started (the resumed iteration).
        description: Label shown before the bar / at the start of each line.
        console: Where to draw (default: a rich console on stdout, which decides whether
            stdout is an interactive terminal).
        plain_interval: Iterations between plain lines (default: 5% of the remaining
            iterations, at least 1).
        enabled: Whether to show anything (default: only on the last rank, the one that
            prints the training log).
        clock: Monotonic clock in seconds (for tests).

    Raises:
        ValueError: ``total`` / ``start`` / ``plain_interval`` are out of range.
    """

    def __init__(
        self,
        total: int,
        *,
        start: int = 0,
        description: str = "training",
        console: Console | None = None,
        plain_interval: int | None = None,
        enabled: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(total, bool) or not isinstance(total, int) or total < 1:
            raise ValueError(f"total must be a positive number of iterations, got {total!r}")
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= total:
            raise ValueError(f"start must be an int in [0, total={total}], got {start!r}")
        if plain_interval is not None and (
            isinstance(plain_interval, bool)
            or not isinstance(plain_interval, int)
            or plain_interval < 1
        ):
            raise ValueError(f"plain_interval must be a positive int, got {plain_interval!r}")
        self.total = total
        self.start_iteration = start
        self.description = description
        self.enabled = is_last_rank() if enabled is None else enabled
        self.console = console or Console()
        self.live = self.enabled and self.console.is_interactive
        self.plain_interval = plain_interval or max(1, (total - start) // 20)
        self._clock = clock
        self._started_at: float | None = None
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._iteration = start
        self._last_printed = start
        self._metrics: dict[str, float] = {}
        self._closed = False

    def start(self) -> Self:
        """Start the clock (and the live bar). Called by ``with``; idempotent."""
        if self._started_at is not None or not self.enabled:
            return self
        self._started_at = self._clock()
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TaskProgressColumn(),
                TextColumn("elapsed"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[metrics]}"),
                console=self.console,
                redirect_stdout=True,
                redirect_stderr=True,
            )
            self._task = self._progress.add_task(
                self.description, total=self.total, completed=self.start_iteration, metrics=""
            )
            self._progress.start()
        return self

    def plain_line(self) -> str:
        """The plain progress line for the current state."""
        done = self._iteration - self.start_iteration
        elapsed = 0.0 if self._started_at is None else self._clock() - self._started_at
        rate = done / elapsed if elapsed > 0 and done > 0 else 0.0
        eta = (self.total - self._iteration) / rate if rate > 0 else None
        parts = [
            f"[{self.description}] {self._iteration}/{self.total} "
            f"({100.0 * self._iteration / self.total:.1f}%)",
            f"elapsed {format_duration(elapsed)}",
            f"ETA {format_duration(eta) if eta is not None else '?'}",
            f"{rate:.2f} it/s",
        ]
        if self._metrics:
            parts.append(_format_metrics(self._metrics))
        return " | ".join(parts)

    def update(self, iteration: int, metrics: Mapping[str, float] | None = None) -> None:
        """Record that ``iteration`` iterations are done, with optional metrics to show.

        Args:
            iteration: Iterations completed (``train_state.step``).
            metrics: Values to show next to the bar (e.g. ``{"lm loss": 2.31}``); they
                replace the previous ones.

        Raises:
            RuntimeError: The reporter is closed.
        """
        if self._closed:
            raise RuntimeError("ProgressReporter is closed")
        if not self.enabled:
            return
        self.start()
        self._iteration = min(max(iteration, self.start_iteration), self.total)
        if metrics is not None:
            self._metrics = {name: float(value) for name, value in metrics.items()}
        if self._progress is not None and self._task is not None:
            self._progress.update(
                self._task, completed=self._iteration, metrics=_format_metrics(self._metrics)
            )
            return
        due = self._iteration - self._last_printed >= self.plain_interval
        if due or (self._iteration == self.total and self._last_printed != self.total):
            self._last_printed = self._iteration
            self.console.print(self.plain_line(), markup=False, highlight=False, soft_wrap=True)

    def close(self) -> None:
        """Stop the live bar (leaving its final state on screen). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
