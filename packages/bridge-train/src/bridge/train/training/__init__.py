"""The training loop, evaluation, ``pretrain`` and the progress log of bridge-train."""

from bridge.train.training.batch_size import rampup_to_step_schedule
from bridge.train.training.eval import evaluate, evaluate_and_print_results
from bridge.train.training.metrics_file import JsonlMetricWriter, read_metrics_file
from bridge.train.training.preflight import check_config_before_launch
from bridge.train.training.pretrain import SetupOutput, pretrain, setup
from bridge.train.training.profiling import TNvtxContext
from bridge.train.training.progress_log import (
    compute_throughputs_and_append_to_progress_log,
    get_start_time_from_progress_log,
)
from bridge.train.training.run_config import save_run_config
from bridge.train.training.train import (
    WeightHashMismatchError,
    checkpoint_and_decide_exit,
    disable_forward_pre_hook,
    enable_forward_pre_hook,
    post_training_step_callbacks,
    save_checkpoint_and_time,
    should_disable_forward_pre_hook,
    train,
    train_step,
)

__all__ = [
    "JsonlMetricWriter",
    "SetupOutput",
    "TNvtxContext",
    "WeightHashMismatchError",
    "check_config_before_launch",
    "checkpoint_and_decide_exit",
    "compute_throughputs_and_append_to_progress_log",
    "disable_forward_pre_hook",
    "enable_forward_pre_hook",
    "evaluate",
    "evaluate_and_print_results",
    "get_start_time_from_progress_log",
    "post_training_step_callbacks",
    "pretrain",
    "rampup_to_step_schedule",
    "read_metrics_file",
    "save_checkpoint_and_time",
    "save_run_config",
    "setup",
    "should_disable_forward_pre_hook",
    "train",
    "train_step",
]
