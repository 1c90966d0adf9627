"""The callback list: order, skipping of hooks nobody overrides, and errors that name the hook."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from core_utils import HOOKS, Callback, CallbackError, CallbackList


@dataclass
class Context:
    iteration: int = 0
    calls: list[str] = field(default_factory=list)


class Recorder(Callback):
    def __init__(self, name: str) -> None:
        self.name = name

    def on_train_start(self, context: Context) -> None:
        context.calls.append(f"{self.name}.train_start")

    def on_step_end(self, context: Context) -> None:
        context.calls.append(f"{self.name}.step_end@{context.iteration}")


class OnlyEnd(Callback):
    def on_train_end(self, context: Context) -> None:
        context.calls.append("end")


class Broken(Callback):
    def on_step_end(self, context: Context) -> None:
        raise ValueError("bad metric")


class ComponentFailure(RuntimeError):
    pass


class BrokenComponent(Callback):
    def on_step_end(self, context: Context) -> None:
        raise ComponentFailure("weights differ")


def test_components_run_before_callbacks_in_registration_order() -> None:
    hooks = CallbackList([Recorder("a"), Recorder("b")], [Recorder("user")])
    context = Context(iteration=3)
    hooks.on_train_start(context)
    hooks.on_step_end(context)
    assert context.calls == [
        "a.train_start",
        "b.train_start",
        "user.train_start",
        "a.step_end@3",
        "b.step_end@3",
        "user.step_end@3",
    ]


def test_after_components_run_after_the_callbacks_and_keep_their_errors() -> None:
    hooks = CallbackList([Recorder("a")], [Recorder("user")], after=[Recorder("save")])
    context = Context(iteration=2)
    hooks.on_step_end(context)
    assert context.calls == ["a.step_end@2", "user.step_end@2", "save.step_end@2"]
    with pytest.raises(ComponentFailure):  # a component's error is not wrapped
        CallbackList((), [Recorder("user")], after=[BrokenComponent()]).on_step_end(context)


def test_hooks_nobody_overrides_are_not_dispatched() -> None:
    hooks = CallbackList([], [OnlyEnd()])
    assert [hook for hook in HOOKS if hooks.has(hook)] == ["on_train_end"]
    context = Context()
    for hook in HOOKS:
        hooks.fire(hook, context)
    assert context.calls == ["end"]
    assert not CallbackList().has("on_step_end")


def test_user_callback_error_names_callback_hook_and_iteration() -> None:
    hooks = CallbackList([Recorder("a")], [Broken()])
    context = Context(iteration=7)
    with pytest.raises(CallbackError) as info:
        hooks.on_step_end(context)
    assert (
        str(info.value)
        == "callback Broken.on_step_end raised at iteration 7: ValueError: bad metric"
    )
    assert isinstance(info.value.__cause__, ValueError)
    assert info.value.hook == "on_step_end" and info.value.iteration == 7
    assert context.calls == ["a.step_end@7"]


def test_component_errors_propagate_unchanged() -> None:
    with pytest.raises(ComponentFailure, match="weights differ"):
        CallbackList([BrokenComponent()]).on_step_end(Context())


def test_non_callbacks_are_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match=r"subclass core_utils\.Callback"):
        CallbackList([], [object()])  # type: ignore[list-item]


def test_unknown_hook_is_a_key_error() -> None:
    with pytest.raises(KeyError):
        CallbackList().fire("on_epoch_end", Context())
