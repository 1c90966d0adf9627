"""Pass the :class:`~bridge.train.GlobalState` to forward-step functions that ask for it.

A forward-step function follows megatron's convention ``(data_iterator, model)`` (optionally
followed by ``return_schedule_plan`` or ``checkpoint_activations_microbatch``), or takes the
global state first: ``(state, data_iterator, model)``. A function asks for the state by
annotating any parameter with ``GlobalState`` or by naming its first parameter ``state`` or
``global_state``. :func:`prepare_forward_step_func` binds the state once with
``functools.partial`` so the schedule can call every function as
``func(data_iterator, model)``.
"""

from __future__ import annotations

import functools
import inspect
import re
import typing
from collections.abc import Callable
from typing import Any

from bridge.train.state import ForwardStepCallable, GlobalState

__all__ = [
    "ForwardStepCallable",
    "maybe_inject_state",
    "needs_global_state_injection",
    "prepare_forward_step_func",
]

_STATE_PARAMETER_NAMES = ("state", "global_state")


def _is_global_state_annotation(annotation: Any) -> bool:
    if isinstance(annotation, type):  # also inspect.Parameter.empty, a class: no annotation
        # Megatron-Bridge's own GlobalState (or any class of that name, or a subclass of
        # one) asks for the state too: code ported from it keeps its annotations.
        return any(klass.__name__ == "GlobalState" for klass in annotation.__mro__)
    if isinstance(annotation, typing.ForwardRef):
        return _is_global_state_annotation(annotation.__forward_arg__)
    if isinstance(annotation, str):
        # Postponed annotations (``from __future__ import annotations``) that could not be
        # resolved: match the class name, optionally qualified or wrapped in Optional.
        # Quotes stay in when a quoted annotation meets ``from __future__ import annotations``.
        text = re.sub(r"[ '\"]", "", annotation)
        return any(part.split(".")[-1] == "GlobalState" for part in re.split(r"[|\[\],]", text))
    return any(_is_global_state_annotation(arg) for arg in typing.get_args(annotation))


def _signature(func: Callable[..., Any]) -> tuple[inspect.Signature, dict[str, Any]]:
    signature = inspect.signature(func)  # for a functor: its __call__ without ``self``
    target: Any = func
    if isinstance(func, functools.partial):
        target = func.func
    elif not (inspect.isfunction(func) or inspect.ismethod(func)):
        target = type(func).__call__
    try:
        hints = typing.get_type_hints(target)
    except Exception:  # unresolvable forward references: fall back to raw annotations
        hints = {}
    return signature, hints


def needs_global_state_injection(forward_step_func: ForwardStepCallable) -> bool:
    """Whether ``forward_step_func`` expects the global state as its first argument.

    Detection: any parameter annotated with :class:`GlobalState` or another class named
    ``GlobalState`` (Megatron-Bridge's, so ported code keeps working), also inside
    ``Optional[...]`` / ``X | None`` and as a string annotation; otherwise, the first
    parameter being named ``state`` or ``global_state``.

    Args:
        forward_step_func: A forward-step function or callable object.

    Returns:
        True if the state should be injected.
    """
    signature, hints = _signature(forward_step_func)
    params = list(signature.parameters.values())
    for param in params:
        if _is_global_state_annotation(hints.get(param.name, param.annotation)):
            return True
    return bool(params) and params[0].name in _STATE_PARAMETER_NAMES


def maybe_inject_state(
    forward_step_func: ForwardStepCallable,
    state: GlobalState,
    needs_injection: bool | None = None,
) -> ForwardStepCallable:
    """Bind ``state`` as the first argument of ``forward_step_func`` if it expects it.

    Supported signatures: ``(data_iterator, model)`` and
    ``(data_iterator, model, return_schedule_plan)`` are returned unchanged;
    ``(state, data_iterator, model)`` and ``(state, data_iterator, model,
    return_schedule_plan)`` become ``functools.partial(func, state)``.

    Args:
        forward_step_func: The original forward-step function or functor.
        state: The global state to inject.
        needs_injection: Skip the signature inspection when already known.

    Returns:
        The original callable or a partial with ``state`` bound.
    """
    if needs_injection is None:
        needs_injection = needs_global_state_injection(forward_step_func)
    if needs_injection:
        return functools.partial(forward_step_func, state)
    return forward_step_func


def prepare_forward_step_func(
    forward_step_func: ForwardStepCallable, state: GlobalState
) -> ForwardStepCallable:
    """Inspect ``forward_step_func`` once and inject ``state`` if it expects it.

    Call it once before the training or evaluation loop. The partial holds a reference to
    ``state`` (not a copy), so later changes to ``state.train_state`` are visible to the
    function; a functor keeps its own attributes because the instance itself is bound.

    Args:
        forward_step_func: The original forward-step function or functor.
        state: The global state to inject if needed.

    Returns:
        The wrapped function (if injection is needed) or the original one.
    """
    return maybe_inject_state(forward_step_func, state)
