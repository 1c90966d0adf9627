"""The profiler component: starts the torch profiler or an Nsight Systems range at
``profiling.profile_step_start``, steps it after every iteration, stops it at
``profiling.profile_step_end`` (or when the loop ends first)."""

from __future__ import annotations

from pathlib import Path

import torch

from bridge.config import ProfilingConfig
from bridge.train.loop.components.maintenance import _completed
from bridge.train.loop.profiling import (
    TNvtxContext,
    start_profiler,
    stop_profiler,
)
from core_utils.callbacks import Callback
from core_utils.loop import LoopContext

__all__ = ["Profiler", "step_profiler"]


def step_profiler(
    prof: torch.profiler.profile | None,
    nsys_nvtx_context: TNvtxContext | None,
    iteration: int,
    profiling: ProfilingConfig | None,
) -> bool:
    """Step the torch profiler after ``iteration``; stop profiling at its end step.

    Returns:
        True when profiling was stopped.
    """
    if profiling is None or (prof is None and nsys_nvtx_context is None):
        return False
    if prof is not None:
        prof.step()
    if iteration >= profiling.profile_step_end:
        stop_profiler(prof, nsys_nvtx_context)
        return True
    return False


class Profiler(Callback):
    """Profiles iterations ``[profile_step_start, profile_step_end)`` on the chosen ranks.

    Args:
        profiling: The ``profiling`` section.
        trace_dir: Where the torch profiler writes its trace (see
            :func:`bridge.train.loop.profiling.profile_trace_dir`).
    """

    def __init__(self, profiling: ProfilingConfig, trace_dir: Path | None) -> None:
        self.profiling = profiling
        self.trace_dir = trace_dir
        self.prof: torch.profiler.profile | None = None
        self.nsys_context: TNvtxContext | None = None

    @property
    def running(self) -> bool:
        """Whether a profiler is running now."""
        return self.prof is not None or self.nsys_context is not None

    def on_step_start(self, context: LoopContext) -> None:
        """Start profiling when the iteration enters the profiled range."""
        profiling = self.profiling
        if (
            not self.running
            and profiling.profile_step_start <= context.iteration < profiling.profile_step_end
        ):
            self.prof, self.nsys_context = start_profiler(profiling, self.trace_dir)

    def on_step_end(self, context: LoopContext) -> None:
        """Step the profiler; stop it after the last profiled iteration."""
        if _completed(context) and step_profiler(
            self.prof, self.nsys_context, context.iteration, self.profiling
        ):
            self.prof, self.nsys_context = None, None

    def on_train_end(self, context: LoopContext) -> None:
        """Stop a profiler still running (the run ended inside the profiled range)."""
        self.close()

    def close(self) -> None:
        """Stop the profiler if it runs (idempotent; also after an error)."""
        stop_profiler(self.prof, self.nsys_context)
        self.prof, self.nsys_context = None, None
