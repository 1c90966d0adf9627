"""The reference's loop functions (``train``, ``train_step``, ...) as thin adapters."""

from bridge.train.api.train import (
    checkpoint_and_decide_exit,
    post_training_step_callbacks,
    save_checkpoint_and_time,
    train,
    train_step,
)

__all__ = [
    "checkpoint_and_decide_exit",
    "post_training_step_callbacks",
    "save_checkpoint_and_time",
    "train",
    "train_step",
]
