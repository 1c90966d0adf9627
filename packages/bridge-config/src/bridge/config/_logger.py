"""The logging and profiling sections."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

from bridge.config._checks import at_least
from bridge.config._codec import normalize_fields
from bridge.config._errors import field_error, section_error
from bridge.config._section import config_section


@config_section
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

    throughput_window_size: int | None = None
    """Iterations in the rolling window of the ``throughput/*`` rates (written when
    ``log_throughput`` is on). Unset: ``log_interval``."""

    log_runtime_to_tensorboard: bool = False
    """Write ``time/remaining_estimate``, ``time/tokens``, ``time/samples``,
    ``time/batches`` and ``time/total`` every ``tensorboard_log_interval`` iterations."""

    runtime_time_unit: Literal["seconds", "minutes", "hours", "days"] = "seconds"
    """Unit of the ``time/*`` durations written by ``log_runtime_to_tensorboard``."""

    log_l2_norm_grad_to_tensorboard: bool = False
    """Write ``l2_norm/grad/global`` and one ``l2_norm/grad/<parameter>`` per parameter every
    ``tensorboard_log_interval`` iterations (a collective over the model-parallel group)."""

    memory_keys: dict[str, str] | None = None
    """``torch.cuda.memory_stats()`` keys written by ``log_memory_to_tensorboard`` and the
    names they are written under (unset: bridge.logging's ``MEMORY_KEYS``, the
    ``memory/*`` keys)."""

    wandb_project: str | None = None
    """Weights & Biases project (unset: no Weights & Biases logging)."""

    wandb_exp_name: str | None = None
    """Weights & Biases run name."""

    wandb_save_dir: str | None = None
    """Local directory for Weights & Biases files."""

    wandb_entity: str | None = None
    """Weights & Biases entity (user or team)."""

    mlflow_experiment: str | None = None
    """MLflow experiment name (created if missing); setting it turns MLflow logging on
    (``pip install bridge-logging[mlflow]``)."""

    mlflow_run_name: str | None = None
    """MLflow run name (unset: ``wandb_exp_name`` if set, else a name MLflow picks)."""

    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI: ``http://host:5000``, ``databricks``, or ``file:./mlruns`` (a
    local file store; MLflow 3 needs ``MLFLOW_ALLOW_FILE_STORE=true`` for it). Unset: the
    ``MLFLOW_TRACKING_URI`` environment variable, which must then be set."""

    mlflow_tags: dict[str, str] | None = None
    """Tags set on the MLflow run."""

    comet_project: str | None = None
    """Comet project name; setting it turns Comet logging on
    (``pip install bridge-logging[comet]``)."""

    comet_experiment_name: str | None = None
    """Comet experiment name (unset: ``wandb_exp_name`` if set)."""

    comet_workspace: str | None = None
    """Comet workspace (unset: the API key's default workspace)."""

    comet_tags: list[str] | None = None
    """Tags added to the Comet experiment."""

    comet_mode: Literal["auto", "online", "offline"] = "auto"
    """``"online"`` needs an API key (``COMET_API_KEY`` or ``comet login``; keys are never
    read from the config, which is logged as run parameters). ``"offline"`` writes a zip
    archive to upload later with ``comet upload``. ``"auto"``: offline when
    ``COMET_MODE=offline`` is exported or no API key is configured, online otherwise."""

    comet_offline_dir: str | None = None
    """Directory of Comet's offline archives (unset: ``COMET_OFFLINE_DIRECTORY`` or
    ``.cometml-runs``)."""

    # Differs from the reference page, which renders this non-literal default as None: the
    # field is an int logging level, and None is neither. Listed under "Differences from
    # the reference" in docs/configuration.md.
    logging_level: int = logging.INFO
    """Level for the Python loggers (``logging.INFO`` is 20, ``DEBUG`` 10, ``WARNING`` 30)."""

    filter_warnings: bool = True
    """Filter out warning messages of other libraries; this project's own warnings (``bridge.*``
    and ``core_utils.*`` loggers: a hang, a straggler, a signal received) are always shown."""

    modules_to_filter: list[str] | None = None
    """Names of modules whose log records are dropped."""

    set_level_for_all_loggers: bool = False
    """Apply ``logging_level`` to every logger, not only this project's loggers."""

    log_energy: bool = False
    """Log energy consumption in joules."""

    metrics_writer_mode: Literal["process", "inline"] = "process"
    """Where the metric backends (TensorBoard, Weights & Biases, MLflow, Comet) write.
    ``"process"``: in a writer process started by the last rank, so their I/O stays off the
    training step (the step hands one message per step to a pipe). ``"inline"``: in the
    training process, for environments where a subprocess is not wanted."""

    def __post_init__(self) -> None:
        """Check the field types, intervals, logging level and backend names."""
        normalize_fields(self)
        at_least(self, "log_interval", 1, allow_none=False)
        at_least(self, "tensorboard_log_interval", 1, allow_none=False)
        at_least(self, "tensorboard_queue_size", 1, allow_none=False)
        at_least(self, "logging_level", 0, allow_none=False)
        at_least(self, "throughput_window_size", 1)
        for name in _NAME_FIELDS:
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise field_error(
                    self, name, value, "expected a non-empty string, or null to leave it unset"
                )
        if self.memory_keys is not None and not self.memory_keys:
            raise field_error(
                self,
                "memory_keys",
                self.memory_keys,
                "expected a non-empty mapping of torch.cuda.memory_stats() keys to report "
                "names, or null for the default memory/* keys",
            )
        for name in ("mlflow_tags", "comet_tags"):
            tags = getattr(self, name)
            keys = tags if isinstance(tags, list) else list(tags or ())
            if any(not key.strip() for key in keys):
                raise field_error(self, name, tags, "tags must be non-empty strings")


# Optional MLflow / Comet names and locations: unset is null, never an empty string (which
# would otherwise turn a backend on with a name it rejects).
_NAME_FIELDS = (
    "mlflow_experiment",
    "mlflow_run_name",
    "mlflow_tracking_uri",
    "comet_project",
    "comet_experiment_name",
    "comet_workspace",
    "comet_offline_dir",
)


@config_section
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
