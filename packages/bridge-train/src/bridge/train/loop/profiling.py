"""Profiling of the steps between ``profiling.profile_step_start`` and ``profile_step_end``.

Two profilers, on the ranks in ``profiling.profile_ranks`` only:

* ``use_pytorch_profiler``: torch's profiler records from the start of iteration
  ``profile_step_start + 1`` (i.e. once ``train_state.step == profile_step_start``) to the
  end of iteration ``profile_step_end``, marking every iteration as a profiler step, and
  writes a trace that TensorBoard's profiler plugin (or ``chrome://tracing`` / Perfetto)
  opens, to ``logger.tensorboard_dir`` or, without it, ``<checkpoint.save>/profile``.
* ``use_nsys_profiler``: ``cudaProfilerStart`` / ``cudaProfilerStop`` around the same
  iterations, with NVTX ranges per iteration, for ``nsys profile
  --capture-range=cudaProfilerApi``. CUDA only: on a machine without CUDA the trainer
  refuses to start with a message saying so.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from bridge.config import CheckpointConfig, LoggerConfig, ProfilingConfig
from bridge.train.checkpointing.layout import PROFILE_SUBDIR
from core_utils.distributed import global_rank

__all__ = [
    "TNvtxContext",
    "nsys_unavailable_reason",
    "profile_trace_dir",
    "should_profile_rank",
    "start_profiler",
    "stop_profiler",
]

TNvtxContext = contextlib.AbstractContextManager[Any]
"""The NVTX range open around the profiled iterations (``None`` when nsys is off)."""


def should_profile_rank(profiling: ProfilingConfig | None) -> bool:
    """Whether this rank profiles (a profiler is on and the rank is in ``profile_ranks``)."""
    if profiling is None:
        return False
    if not (profiling.use_pytorch_profiler or profiling.use_nsys_profiler):
        return False
    return global_rank(launcher_fallback=True) in set(profiling.profile_ranks)


def nsys_unavailable_reason() -> str | None:
    """Why nsys profiling cannot run here, or ``None`` when it can (CUDA is available)."""
    if not torch.cuda.is_available():
        return (
            "profiling.use_nsys_profiler requires CUDA (it brackets the profiled iterations "
            "with cudaProfilerStart/Stop for nsys); use profiling.use_pytorch_profiler on CPU"
        )
    return None


def profile_trace_dir(
    logger: LoggerConfig | None, checkpoint: CheckpointConfig | None
) -> Path | None:
    """Where the torch profiler writes: ``logger.tensorboard_dir``, else ``<save>/profile``."""
    tensorboard_dir = logger.tensorboard_dir if logger is not None else None
    if tensorboard_dir:
        return Path(tensorboard_dir)
    save = checkpoint.save if checkpoint is not None else None
    return Path(save) / PROFILE_SUBDIR if save else None


def start_profiler(
    profiling: ProfilingConfig | None, trace_dir: Path | None
) -> tuple[torch.profiler.profile | None, TNvtxContext | None]:
    """Start the configured profiler on this rank (call when ``step == profile_step_start``).

    Args:
        profiling: The ``profiling`` section.
        trace_dir: Where the torch profiler writes (see :func:`profile_trace_dir`).

    Returns:
        ``(torch profiler or None, NVTX context or None)``.

    Raises:
        RuntimeError: nsys profiling without CUDA, or the torch profiler without a
            directory for its trace.
    """
    if profiling is None or not should_profile_rank(profiling):
        return None, None
    if profiling.use_nsys_profiler:
        reason = nsys_unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
        context: TNvtxContext = torch.autograd.profiler.emit_nvtx(
            record_shapes=profiling.record_shapes
        )
        context.__enter__()
        return None, context
    if trace_dir is None:
        raise RuntimeError(
            "profiling.use_pytorch_profiler needs logger.tensorboard_dir or checkpoint.save "
            "for its trace"
        )
    # No activities given: torch's supported ones (CPU, and CUDA where it traces kernels).
    prof = torch.profiler.profile(
        record_shapes=profiling.record_shapes,
        on_trace_ready=torch.profiler.tensorboard_trace_handler(
            str(trace_dir), worker_name=f"rank{global_rank(launcher_fallback=True)}"
        ),
    )
    prof.start()
    return prof, None


def stop_profiler(
    prof: torch.profiler.profile | None, nsys_nvtx_context: TNvtxContext | None
) -> None:
    """Stop whichever profiler :func:`start_profiler` started (writes the torch trace)."""
    if prof is not None:
        prof.stop()
    if nsys_nvtx_context is not None:
        nsys_nvtx_context.__exit__(None, None, None)
        torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
