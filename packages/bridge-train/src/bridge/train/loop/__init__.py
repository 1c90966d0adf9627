"""The training loop: GPT-style training on core-utils' driver (``run_loop``), its
components, evaluation, and the ``pretrain`` / ``pretrain_mimo`` entry points."""

from bridge.train.loop.batch_size import rampup_to_step_schedule
from bridge.train.loop.eval import Evaluation
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
from bridge.train.loop.saving import CheckpointWriter
from bridge.train.loop.step import TrainStep
from bridge.train.loop.training import RunComponents, run_training
from core_utils.loop import LoopContext, StepFunction, StepResult, run_loop

__all__ = [
    "CheckpointWriter",
    "Evaluation",
    "LoopContext",
    "RunComponents",
    "SetupOutput",
    "StepFunction",
    "StepResult",
    "TNvtxContext",
    "TrainStep",
    "compute_throughputs_and_append_to_progress_log",
    "disable_forward_pre_hook",
    "enable_forward_pre_hook",
    "get_start_time_from_progress_log",
    "pretrain",
    "rampup_to_step_schedule",
    "run_loop",
    "run_training",
    "save_run_config",
    "setup",
    "should_disable_forward_pre_hook",
]
