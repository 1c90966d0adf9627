"""What every bridge.config section class shares: checked constructor calls and fill-ins.

Every section (and ``ConfigContainer``) is declared ``@config_section`` on top of
``@dataclass(kw_only=True)``. The decorator gives it two behaviours:

* A call with an unknown, misspelt, computed, missing or positional argument raises a
  :class:`~bridge.config._errors.ConfigError` naming ``Class.field`` with a did-you-mean
  hint, the same message YAML input gets, instead of Python's bare ``TypeError``.
* Values ``ConfigContainer.validate()`` fills into fields the user left unset are remembered
  (:func:`fill_in`). Saving writes them as unset, and the next ``validate()`` derives them
  again (after overrides or at another world size). Assigning a field by hand makes it the
  user's value again.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import Any

from bridge.config._errors import ConfigArgumentError, suggest
from bridge.config._typing import field_types, type_name

# Instance attribute (not a dataclass field, so equality and encoding ignore it) mapping the
# name of each field validate() filled in to the value it filled in.
_FILLED = "_bridge_config_filled"


def unknown_key_detail(cls: type, key: str, choices: Iterable[str]) -> str:
    """The message for a key that names no field of ``cls``, with the closest field."""
    visible = [name for name in choices if not name.startswith("_")]
    noun = getattr(cls, "__config_key_noun__", "field")
    listing = f" Valid {noun}s: {', '.join(visible)}." if len(visible) <= 40 else ""
    return f"unknown {noun} of {cls.__qualname__}.{suggest(key, visible)}{listing}"


_Signature = tuple[tuple[str, ...], frozenset[str], frozenset[str], tuple[str, ...]]
_SIGNATURES: dict[type, _Signature] = {}


def _signature(cls: type) -> _Signature:
    """A dataclass's field names: settable (in order, and as a set), computed, required."""
    cached = _SIGNATURES.get(cls)
    if cached is None:
        fields = dataclasses.fields(cls)
        init = tuple(f.name for f in fields if f.init)
        required = tuple(
            f.name
            for f in fields
            if f.init
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        )
        computed = frozenset(f.name for f in fields if not f.init)
        cached = _SIGNATURES[cls] = (init, frozenset(init), computed, required)
    return cached


def _argument_error(
    cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> ConfigArgumentError:
    name = cls.__name__
    if args:
        return ConfigArgumentError(
            name,
            f"takes keyword arguments only (got positional {', '.join(repr(a) for a in args)[:80]});"
            f" write {name}(<field>=<value>, ...)",
        )
    init_names, _, computed, required = _signature(cls)
    for key in kwargs:
        if key in computed:
            return ConfigArgumentError(
                f"{name}.{key}",
                f"cannot be set: it is fixed or computed by {name} (or by "
                "ConfigContainer.validate())",
            )
        if key not in init_names:
            return ConfigArgumentError(f"{name}.{key}", unknown_key_detail(cls, key, init_names))
    missing = [n for n in required if n not in kwargs]
    hints = field_types(cls)
    also = f"; also missing: {', '.join(missing[1:])}" if len(missing) > 1 else ""
    return ConfigArgumentError(
        f"{name}.{missing[0]}",
        f"required field of {cls.__qualname__} is missing ({type_name(hints[missing[0]])}){also}",
    )


def _setattr(self: Any, name: str, value: Any) -> None:
    filled = self.__dict__.get(_FILLED)
    if filled and name in filled:
        # A new dict rather than an edit: shallow copies of the section share the old one.
        self.__dict__[_FILLED] = {k: v for k, v in filled.items() if k != name}
    object.__setattr__(self, name, value)


def config_section[C: type](cls: C) -> C:
    """Class decorator for a bridge.config section, applied above ``@dataclass(kw_only=True)``.

    Args:
        cls: The dataclass.

    Returns:
        The same class, whose constructor raises ``ConfigError`` (also a ``TypeError``) for
        bad arguments and whose field assignments clear the fill-in mark of that field.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"config_section expects a dataclass, got {cls!r}")
    init = vars(cls)["__init__"]

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        owner = type(self)
        _, accepted, _, required = _signature(owner)
        if args or not kwargs.keys() <= accepted or not all(n in kwargs for n in required):
            raise _argument_error(owner, args, kwargs)
        init(self, **kwargs)

    type.__setattr__(cls, "__init__", __init__)
    type.__setattr__(cls, "__setattr__", _setattr)
    return cls


# ----------------------------------------------------------------------------- fill-ins


def fill_in(obj: Any, name: str, value: Any) -> None:
    """Set ``obj.<name>`` to a value ``validate()`` derived, and remember that it did.

    Objects without an instance ``__dict__`` get the value without the mark (it is then
    saved like a value the user set).
    """
    setattr(obj, name, value)
    state = getattr(obj, "__dict__", None)
    if state is not None:
        state[_FILLED] = {**state.get(_FILLED, {}), name: value}


def filled_fields(obj: Any) -> dict[str, Any]:
    """The fields of ``obj`` still holding the value ``validate()`` filled in, with those values.

    A field assigned since (through a bridge.config section's ``__setattr__``, or any
    change of value on another object) is the user's again and is not listed.
    """
    state = getattr(obj, "__dict__", None)
    filled = state.get(_FILLED) if state is not None else None
    if not filled:
        return {}
    return {
        name: value
        for name, value in filled.items()
        if (current := getattr(obj, name, None)) is value or _equal(current, value)
    }


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # an object whose == does not give a truth value
        return False


def clear_fill_ins(obj: Any) -> dict[str, Any]:
    """Set every filled-in field of ``obj`` back to unset (``None``) and forget the marks.

    Returns:
        The fields cleared and the values they held, for :func:`restore_fill_ins`.
    """
    filled = filled_fields(obj)
    for name in filled:
        setattr(obj, name, None)
    state = getattr(obj, "__dict__", None)
    if state is not None:
        state.pop(_FILLED, None)
    return filled


def restore_fill_ins(obj: Any, values: dict[str, Any]) -> None:
    """Put back the fill-ins :func:`clear_fill_ins` removed (after a failed ``validate()``)."""
    for name, value in values.items():
        fill_in(obj, name, value)
