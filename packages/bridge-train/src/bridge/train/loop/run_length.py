"""When a run has finished: the one rule the loop and ``pretrain`` share."""

from __future__ import annotations

from bridge.config import TrainingConfig
from core_utils.loop import TrainProgress

__all__ = ["run_is_done"]


def run_is_done(train_config: TrainingConfig, train_state: TrainProgress) -> bool:
    """Return whether the run has reached its configured length.

    A sample-based run (``train.train_samples`` set) is done once it has consumed that many
    samples; otherwise it is done after ``train.train_iters`` iterations (a run with
    neither is done at once).

    Args:
        train_config: The ``train`` section (``TrainingConfig``).
        train_state: The run's ``TrainState`` (``step``, ``consumed_train_samples``).

    Returns:
        True when no further iteration should run.
    """
    if train_config.train_samples is not None:
        return bool(train_state.consumed_train_samples >= train_config.train_samples)
    return bool(train_state.step >= (train_config.train_iters or 0))
