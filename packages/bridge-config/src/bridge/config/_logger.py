"""The logging and profiling sections."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

from bridge.config._checks import at_least
from bridge.config._codec import normalize_fields
from bridge.config._errors import field_error, section_error


@dataclass(kw_only=True)
class LoggerConfig:
    """Configuration settings for logging, including TensorBoard and WandB."""

    log_interval: int = 100
    """Print the loss and timing line every this many iterations."""

    log_params_norm: bool = False
    """Compute and log the norm of all parameters."""

    log_throughput: bool = False
    """Compute and log throughput per GPU."""

    log_progress: bool = False
    """Append processed tokens and floating-point operations to ``progress.txt`` in the
    checkpoint directory."""

    timing_log_level: Literal[0, 1, 2] = 0
    """Which timers are measured and reported. 0: only the iteration time, with no extra
    overhead; 1: operations that run about once per iteration (such as the gradient
    all-reduce); 2: also operations that run many times per iteration. Levels 1 and 2 can
    slow iterations down."""

    timing_log_option: Literal["max", "minmax", "all"] = "minmax"
    """How timers are reported across ranks: ``"max"`` the slowest rank, ``"minmax"`` the
    fastest and slowest, ``"all"`` every rank."""

    tensorboard_dir: str | None = None
    """Directory for TensorBoard event files (unset: no TensorBoard)."""

    tensorboard_log_interval: int = 1
    """Write to TensorBoard every this many iterations."""

    tensorboard_queue_size: int = 1000
    """Pending TensorBoard events and summaries held before a write forces a flush to disk."""

    log_timers_to_tensorboard: bool = False
    """Write timer values to TensorBoard."""

    log_loss_scale_to_tensorboard: bool = True
    """Write the loss scale to TensorBoard (set false to leave it out)."""

    log_validation_ppl_to_tensorboard: bool = False
    """Write validation perplexity to TensorBoard."""

    log_memory_to_tensorboard: bool = False
    """Write memory statistics to TensorBoard."""

    log_world_size_to_tensorboard: bool = False
    """Write the world size to TensorBoard."""

    wandb_project: str | None = None
    """Weights & Biases project (unset: no Weights & Biases logging)."""

    wandb_exp_name: str | None = None
    """Weights & Biases run name."""

    wandb_save_dir: str | None = None
    """Local directory for Weights & Biases files."""

    wandb_entity: str | None = None
    """Weights & Biases entity (user or team)."""

    logging_level: int = logging.INFO
    """Level for the Python loggers (``logging.INFO`` is 20, ``DEBUG`` 10, ``WARNING`` 30)."""

    filter_warnings: bool = True
    """Filter out warning messages."""

    modules_to_filter: list[str] | None = None
    """Names of modules whose log records are dropped."""

    set_level_for_all_loggers: bool = False
    """Apply ``logging_level`` to every logger, not only this project's loggers."""

    log_energy: bool = False
    """Log energy consumption in joules."""

    def __post_init__(self) -> None:
        """Check the field types, intervals and logging level."""
        normalize_fields(self)
        at_least(self, "log_interval", 1, allow_none=False)
        at_least(self, "tensorboard_log_interval", 1, allow_none=False)
        at_least(self, "tensorboard_queue_size", 1, allow_none=False)
        at_least(self, "logging_level", 0, allow_none=False)


@dataclass(kw_only=True)
class ProfilingConfig:
    """Configuration settings for profiling the training process."""

    use_nsys_profiler: bool = False
    """Mark the profiled steps for Nsight Systems; run under ``nsys profile -s none -t
    nvtx,cuda -o <output> --force-overwrite true --capture-range=cudaProfilerApi
    --capture-range-end=stop``. Exclusive with ``use_pytorch_profiler``."""

    profile_step_start: int = 10
    """Global step at which profiling starts."""

    profile_step_end: int = 12
    """Global step at which profiling stops (greater than ``profile_step_start``)."""

    use_pytorch_profiler: bool = False
    """Profile with torch's built-in profiler (viewable in TensorBoard)."""

    profile_ranks: list[int] = field(default_factory=lambda: [0])
    """Global ranks that are profiled."""

    record_memory_history: bool = False
    """Record the CUDA memory allocation history on the last rank."""

    memory_snapshot_path: str = "snapshot.pickle"
    """File the memory history is written to."""

    record_shapes: bool = False
    """Record tensor shapes in the profile."""

    def __post_init__(self) -> None:
        """Check the field types, the step range, the ranks and the choice of profiler."""
        normalize_fields(self)
        at_least(self, "profile_step_start", 0, allow_none=False)
        if self.profile_step_end <= self.profile_step_start:
            raise field_error(
                self,
                "profile_step_end",
                self.profile_step_end,
                f"it must be greater than profile_step_start ({self.profile_step_start})",
            )
        if self.use_nsys_profiler and self.use_pytorch_profiler:
            raise section_error(
                self,
                "use_nsys_profiler and use_pytorch_profiler are mutually exclusive; enable one profiler",
            )
        negative = [r for r in self.profile_ranks if r < 0]
        if negative:
            raise field_error(
                self, "profile_ranks", self.profile_ranks, "ranks must be non-negative"
            )
