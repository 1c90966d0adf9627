"""run_is_done: the single rule for when a run has reached its configured length."""

from __future__ import annotations

from bridge.config import TrainingConfig
from bridge.train.loop.run_length import run_is_done
from bridge.train.state import TrainState


def _state(step: int, samples: int) -> TrainState:
    state = TrainState()
    state.step, state.consumed_train_samples = step, samples
    return state


def test_an_iteration_based_run_ends_at_train_iters() -> None:
    train = TrainingConfig(micro_batch_size=1, global_batch_size=4, train_iters=3)
    assert not run_is_done(train, _state(2, 8))
    assert run_is_done(train, _state(3, 12))


def test_a_sample_based_run_ends_at_train_samples_whatever_the_step() -> None:
    train = TrainingConfig(micro_batch_size=1, global_batch_size=4, train_samples=10)
    assert not run_is_done(train, _state(100, 9))
    assert run_is_done(train, _state(1, 10))


def test_a_run_without_a_length_is_done_at_once() -> None:
    train = TrainingConfig(micro_batch_size=1, global_batch_size=4)
    assert run_is_done(train, _state(0, 0))
