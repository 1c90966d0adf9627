"""The training loop: the driver, GPT-style training on it, evaluation and ``pretrain``."""

from bridge.train.loop.batch_size import rampup_to_step_schedule
from bridge.train.loop.eval import evaluate, evaluate_and_print_results
from bridge.train.loop.forward_pre_hooks import (
    disable_forward_pre_hook,
    enable_forward_pre_hook,
    should_disable_forward_pre_hook,
)
from bridge.train.loop.pretrain import SetupOutput, pretrain, setup
from bridge.train.loop.profiling import TNvtxContext
from bridge.train.loop.progress_log import (
    compute_throughputs_and_append_to_progress_log,
    get_start_time_from_progress_log,
)
from bridge.train.loop.run_config import save_run_config
from bridge.train.loop.run_loop import LoopContext, StepFunction, StepResult, run_loop
from bridge.train.loop.training import run_training, save_checkpoint_and_time

__all__ = [
    "LoopContext",
    "SetupOutput",
    "StepFunction",
    "StepResult",
    "TNvtxContext",
    "compute_throughputs_and_append_to_progress_log",
    "disable_forward_pre_hook",
    "enable_forward_pre_hook",
    "evaluate",
    "evaluate_and_print_results",
    "get_start_time_from_progress_log",
    "pretrain",
    "rampup_to_step_schedule",
    "run_loop",
    "run_training",
    "save_checkpoint_and_time",
    "save_run_config",
    "setup",
    "should_disable_forward_pre_hook",
]
