"""Training metrics to the console, TensorBoard, Weights & Biases, MLflow and Comet."""

from bridge.logging.backends import (
    BackendNotInstalledError,
    CometWriter,
    MetricWriter,
    MlflowWriter,
    TensorBoardWriter,
    WandbWriter,
)
from bridge.logging.energy import EnergyMonitor
from bridge.logging.grad_norm import report_l2_norm_grad
from bridge.logging.memory import (
    MEMORY_KEYS,
    reduce_max_memory_across_pp_group,
    report_memory,
    start_memory_history_recording,
)
from bridge.logging.metric_writers import MetricWriters, build_metric_writers

# The reference's private spellings stay importable from the package; being private, they
# are not in __all__.
from bridge.logging.moe import (
    MoeMetricFanoutWriter,
    _build_moe_metric_writer as _build_moe_metric_writer,
    _MoeMetricFanoutWriter as _MoeMetricFanoutWriter,
    build_moe_metric_writer,
)
from bridge.logging.progress import ProgressReporter
from bridge.logging.progress_log import append_progress_log
from bridge.logging.protocols import LoggingState, TrainProgress
from bridge.logging.python_logging import setup_logging
from bridge.logging.scheduler_job import SchedulerJob, scheduler_job
from bridge.logging.settings import BackendSettings, ReportSettings
from bridge.logging.throughput import report_runtime, report_throughput
from bridge.logging.training_log import (
    TrainingLogSettings,
    build_timers,
    log_training_step,
    tokens_per_sample,
    training_log,
)
from bridge.logging.validation import log_validation_results, validation_line

__all__ = [
    "MEMORY_KEYS",
    "BackendNotInstalledError",
    "BackendSettings",
    "CometWriter",
    "EnergyMonitor",
    "LoggingState",
    "MetricWriter",
    "MetricWriters",
    "MlflowWriter",
    "MoeMetricFanoutWriter",
    "ProgressReporter",
    "ReportSettings",
    "SchedulerJob",
    "TensorBoardWriter",
    "TrainProgress",
    "TrainingLogSettings",
    "WandbWriter",
    "append_progress_log",
    "build_metric_writers",
    "build_moe_metric_writer",
    "build_timers",
    "log_training_step",
    "log_validation_results",
    "reduce_max_memory_across_pp_group",
    "report_l2_norm_grad",
    "report_memory",
    "report_runtime",
    "report_throughput",
    "scheduler_job",
    "setup_logging",
    "start_memory_history_recording",
    "tokens_per_sample",
    "training_log",
    "validation_line",
]
