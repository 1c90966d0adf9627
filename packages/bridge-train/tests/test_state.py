"""TrainState round trips; GlobalState injection into forward-step functions."""

from __future__ import annotations

import functools
from typing import Optional

import pytest
import torch

from bridge.config import ConfigContainer
from bridge.train import (
    GlobalState,
    TrainState,
    maybe_inject_state,
    needs_global_state_injection,
    prepare_forward_step_func,
)
from core_utils import Timers


def test_train_state_round_trips_through_tensors_and_torch_save(tmp_path) -> None:
    state = TrainState(
        step=7,
        consumed_train_samples=56,
        skipped_train_samples=8,
        consumed_valid_samples=16,
        floating_point_operations_so_far=1.5e15,
        do_train=True,
        do_valid=True,
        do_test=False,
    )
    sd = state.state_dict()
    assert sd["step"].dtype == torch.int64
    assert sd["floating_point_operations_so_far"].dtype == torch.float64
    assert sd["do_test"].dtype == torch.bool
    torch.save(sd, tmp_path / "ts.pt")
    restored = TrainState()
    restored.load_state_dict(torch.load(tmp_path / "ts.pt"))
    assert restored == state
    plain = TrainState()
    plain.load_state_dict({k: v.item() for k, v in sd.items()})
    assert plain == state


def test_train_state_load_names_missing_fields() -> None:
    with pytest.raises(KeyError, match=r"missing \[.do_test.\]"):
        TrainState().load_state_dict(
            {k: v for k, v in TrainState().state_dict().items() if k != "do_test"}
        )


def test_global_state_defaults() -> None:
    state = GlobalState()
    assert state.train_state == TrainState()
    assert isinstance(state.cfg, ConfigContainer) and state.cfg.train is None
    assert isinstance(state.timers, Timers) and state.timers.log_level == 0
    assert not state.metric_writers.enabled and not state.fault_tolerance.enabled
    assert not state.straggler_timing.configured and state.signal_handler is None
    assert state.job_floating_point_operations == 0.0
    assert state.start_time > 0


def plain(data_iterator, model):
    return data_iterator, model


def plain_with_plan(data_iterator, model, return_schedule_plan=False):
    return data_iterator, model, return_schedule_plan


def annotated(gs: GlobalState, data_iterator, model):
    return gs, data_iterator, model


def optional_annotated(anything: Optional[GlobalState], data_iterator, model):  # noqa: UP045 - tested on purpose
    return anything, data_iterator, model


def union_annotated(anything: GlobalState | None, data_iterator, model):
    return anything, data_iterator, model


def named_state(state, data_iterator, model):
    return state, data_iterator, model


def named_global_state(global_state, data_iterator, model):
    return global_state, data_iterator, model


def string_annotation(s: "GlobalState", data_iterator, model):  # noqa: UP037 - a string on purpose
    return s, data_iterator, model


def state_not_first(data_iterator, state, model):
    return data_iterator, state, model


class _ForeignModule:
    """Stands in for ``megatron.bridge.training.state``: a GlobalState of another package."""

    class GlobalState:
        pass


ForeignGlobalState = _ForeignModule.GlobalState


class ForeignStateSubclass(ForeignGlobalState):
    pass


def foreign_annotated(s: ForeignGlobalState, data_iterator, model):
    return s, data_iterator, model


def foreign_subclass_annotated(s: ForeignStateSubclass, data_iterator, model):
    return s, data_iterator, model


def foreign_qualified_string(
    s: "megatron.bridge.training.state.GlobalState",  # type: ignore[name-defined] # noqa: F821, UP037
    data_iterator,
    model,
):
    return s, data_iterator, model


def foreign_optional_string(
    s: "mbridge_state.GlobalState | None",  # type: ignore[name-defined] # noqa: F821, UP037
    data_iterator,
    model,
):
    return s, data_iterator, model


class NotTheState:
    pass


def other_class_annotated(s: NotTheState, data_iterator, model):
    return s, data_iterator, model


class Functor:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, state: GlobalState, data_iterator, model):
        self.calls += 1
        return state, data_iterator, model


class PlainFunctor:
    def __call__(self, data_iterator, model):
        return data_iterator, model


@pytest.mark.parametrize(
    ("func", "expected"),
    [
        (plain, False),
        (plain_with_plan, False),
        (annotated, True),
        (optional_annotated, True),
        (union_annotated, True),
        (named_state, True),
        (named_global_state, True),
        (string_annotation, True),
        (foreign_annotated, True),
        (foreign_subclass_annotated, True),
        (foreign_qualified_string, True),
        (foreign_optional_string, True),
        (other_class_annotated, False),
        (state_not_first, False),
        (Functor(), True),
        (PlainFunctor(), False),
        (functools.partial(plain, "it"), False),
    ],
)
def test_needs_global_state_injection(func, expected: bool) -> None:
    assert needs_global_state_injection(func) is expected


def test_injection_binds_the_same_state_object() -> None:
    state = GlobalState()
    wrapped = prepare_forward_step_func(annotated, state)
    got_state, it, model = wrapped("it", "model")
    assert got_state is state and (it, model) == ("it", "model")
    state.train_state.step = 5  # later changes are visible: a reference, not a copy
    assert wrapped("a", "b")[0].train_state.step == 5
    assert prepare_forward_step_func(plain, state) is plain
    # An explicit decision skips the inspection.
    assert maybe_inject_state(named_state, state, needs_injection=False) is named_state
    assert maybe_inject_state(named_state, state, needs_injection=True)("a", "b")[0] is state


def test_functor_keeps_its_own_state_when_wrapped() -> None:
    functor = Functor()
    wrapped = prepare_forward_step_func(functor, GlobalState())
    wrapped("it", "m")
    wrapped("it", "m")
    assert functor.calls == 2
