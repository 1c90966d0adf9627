"""The reference's loop functions (``train``, ``train_step``, ...) and Megatron-Bridge's
evaluation functions, as thin adapters over the loop's parts."""

from bridge.train.api.eval import evaluate, evaluate_and_print_results
from bridge.train.api.train import (
    checkpoint_and_decide_exit,
    post_training_step_callbacks,
    save_checkpoint_and_time,
    train,
    train_step,
)

__all__ = [
    "checkpoint_and_decide_exit",
    "evaluate",
    "evaluate_and_print_results",
    "post_training_step_callbacks",
    "save_checkpoint_and_time",
    "train",
    "train_step",
]
