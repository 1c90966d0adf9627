"""The profiler component: starts the torch profiler or an Nsight Systems range at
``profiling.profile_step_start``, steps it after every iteration, stops it at
``profiling.profile_step_end`` (or when the loop ends first)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from bridge.train.loop.profiling import (
    TNvtxContext,
    should_profile_rank,
    start_profiler,
    stop_profiler,
)
from core_utils.callbacks import Callback

if TYPE_CHECKING:
    from bridge.train.loop.run_loop import LoopContext

__all__ = ["Profiler", "step_profiler"]


def step_profiler(
    prof: torch.profiler.profile | None,
    nsys_nvtx_context: TNvtxContext | None,
    iteration: int,
    profiling: Any,
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
        cfg: The run's ``ConfigContainer`` (its ``profiling`` section; ``None``: off).
    """

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.profiling = cfg.profiling
        self.active_here = self.profiling is not None and should_profile_rank(self.profiling)
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
            self.active_here
            and not self.running
            and profiling.profile_step_start <= context.iteration < profiling.profile_step_end
        ):
            self.prof, self.nsys_context = start_profiler(self.cfg)

    def on_step_end(self, context: LoopContext) -> None:
        """Step the profiler; stop it after the last profiled iteration."""
        result = context.step_result
        if (
            result is not None
            and result.completed
            and self.running
            and step_profiler(self.prof, self.nsys_context, context.iteration, self.profiling)
        ):
            self.prof, self.nsys_context = None, None

    def on_train_end(self, context: LoopContext) -> None:
        """Stop a profiler still running (the run ended inside the profiled range)."""
        self.close()

    def close(self) -> None:
        """Stop the profiler if it runs (idempotent; also after an error)."""
        if self.running:
            stop_profiler(self.prof, self.nsys_context)
            self.prof, self.nsys_context = None, None
