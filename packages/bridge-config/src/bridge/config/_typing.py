"""Introspection of dataclass field types, used to check values and to document fields."""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
import typing
from typing import Any, Literal, Union

_FIELD_TYPES: dict[type, dict[str, Any]] = {}


def field_types(cls: type) -> dict[str, Any]:
    """Return the resolved type of every dataclass field of ``cls``.

    Fields whose annotation cannot be resolved (a forward reference to a name the module
    does not define at runtime, as some third-party classes have) map to ``typing.Any``,
    so their values are accepted as they are rather than rejected wrongly.
    """
    cached = _FIELD_TYPES.get(cls)
    if cached is not None:
        return cached
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # a third-party class with an unresolvable annotation
        hints = {}
        for klass in reversed(cls.__mro__):
            module = sys.modules.get(klass.__module__)
            namespace = vars(module) if module else {}
            for name, annotation in vars(klass).get("__annotations__", {}).items():
                if not isinstance(annotation, str):
                    hints[name] = annotation
                    continue
                try:
                    hints[name] = eval(annotation, namespace, dict(vars(klass)))
                except Exception:
                    hints[name] = Any
    result = {}
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name, Any)
        # Some third-party classes annotate `x: int = None`; their default is still valid.
        if f.default is None and hint is not Any and not _allows_none(hint):
            hint = hint | None if isinstance(hint, type) else typing.Optional[hint]  # noqa: UP045
        result[f.name] = hint
    _FIELD_TYPES[cls] = result
    return result


def _allows_none(tp: Any) -> bool:
    if tp is type(None) or tp is None:
        return True
    if is_union(tp):
        return type(None) in typing.get_args(tp)
    return typing.get_origin(tp) is typing.Literal and None in typing.get_args(tp)


def is_union(tp: Any) -> bool:
    """Whether ``tp`` is ``Union[...]``, ``Optional[...]`` or ``A | B``."""
    return typing.get_origin(tp) in (Union, types.UnionType)


def is_protocol(tp: Any) -> bool:
    """Whether ``tp`` is a ``typing.Protocol`` class."""
    return isinstance(tp, type) and bool(getattr(tp, "_is_protocol", False))


@functools.cache
def protocol_members(tp: type) -> tuple[str, ...]:
    """The attribute and method names a Protocol class requires, in definition order."""
    names: dict[str, None] = {}
    for klass in reversed(tp.__mro__):
        if klass in (object, typing.Generic) or not getattr(klass, "_is_protocol", False):
            continue
        if klass is typing.Protocol:
            continue
        for name in vars(klass).get("__annotations__", {}):
            names[name] = None
        for name, value in vars(klass).items():
            if not name.startswith("_") and callable(value):
                names[name] = None
        if "__call__" in vars(klass):
            names["__call__"] = None
    return tuple(names)


def missing_protocol_members(obj: object, tp: type) -> list[str]:
    """The members of Protocol ``tp`` that ``obj`` lacks (empty when it conforms)."""
    return [name for name in protocol_members(tp) if not hasattr(obj, name)]


def is_torch_dtype_type(tp: Any) -> bool:
    """Whether ``tp`` is ``torch.dtype`` (checked without importing torch)."""
    return isinstance(tp, type) and tp.__module__ == "torch" and tp.__name__ == "dtype"


def is_torch_dtype(value: object) -> bool:
    """Whether ``value`` is a ``torch.dtype`` instance (checked without importing torch)."""
    return is_torch_dtype_type(type(value))


def type_name(tp: Any) -> str:
    """Render a type annotation the way a user writes it, for messages and docs."""
    if tp is Any:
        return "Any"
    if tp is type(None) or tp is None:
        return "None"
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        return "Literal[" + ", ".join(repr(a) for a in args) + "]"
    if is_union(tp):
        rest = [a for a in args if a is not type(None)]
        rendered = " | ".join(type_name(a) for a in rest)
        return f"Optional[{rendered}]" if len(rest) < len(args) else rendered
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        if not args or name == "Callable":
            return name
        return f"{name}[" + ", ".join("..." if a is Ellipsis else type_name(a) for a in args) + "]"
    if isinstance(tp, type):
        if is_torch_dtype_type(tp):
            return "torch.dtype"
        if tp.__module__ in ("builtins", "typing") or tp.__module__.startswith("bridge.config"):
            return tp.__name__
        return f"{tp.__module__}.{tp.__qualname__}"
    return str(tp).replace("typing.", "")
