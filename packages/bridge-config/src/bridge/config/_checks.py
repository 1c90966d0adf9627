"""Range and consistency checks shared by the sections' ``__post_init__`` methods.

The range checks are written as ``not (value >= bound)`` so that NaN, for which every
comparison is false, fails them too (``normalize_fields`` already rejects it first).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bridge.config._errors import field_error, section_error


def at_least(obj: Any, name: str, minimum: float, *, allow_none: bool = True) -> None:
    """Require ``obj.<name> >= minimum`` (``None`` passes when ``allow_none``)."""
    value = getattr(obj, name)
    if value is None:
        if allow_none:
            return
        raise field_error(obj, name, value, f"it is required (a number >= {minimum})")
    if not value >= minimum:
        what = "a positive integer" if minimum == 1 else f"a value >= {minimum}"
        raise field_error(obj, name, value, f"expected {what}")


def greater_than(obj: Any, name: str, bound: float, *, allow_none: bool = True) -> None:
    """Require ``obj.<name> > bound`` (``None`` passes when ``allow_none``)."""
    value = getattr(obj, name)
    if value is None and allow_none:
        return
    if value is None or not value > bound:
        raise field_error(obj, name, value, f"expected a value > {bound}")


def within(
    obj: Any,
    name: str,
    low: float,
    high: float,
    *,
    low_open: bool = False,
    allow_none: bool = True,
) -> None:
    """Require ``low <= obj.<name> <= high`` (``low < ...`` when ``low_open``)."""
    value = getattr(obj, name)
    if value is None and allow_none:
        return
    ok = value is not None and (low < value if low_open else low <= value) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise field_error(obj, name, value, f"expected a value in {bracket}{low}, {high}]")


def at_most_one(
    obj: Any, *names: str, unset: tuple[Any, ...] | Mapping[str, tuple[Any, ...]] = (None,)
) -> None:
    """Require that at most one of the named fields holds a value other than its unset one.

    Args:
        obj: The section.
        *names: The mutually exclusive fields.
        unset: The values meaning "not set": one tuple for every field, or a tuple per field
            name (fields not in the mapping use ``(None,)``). Give a field only the values
            that really mean unset: a warmup fraction of ``0.0`` is a choice, not unset.
    """

    def is_set(name: str) -> bool:
        values = unset.get(name, (None,)) if isinstance(unset, Mapping) else unset
        value = getattr(obj, name)
        # Compared by identity and type as well as ==, so that 0.0 or False does not pass
        # for an unset 0 or None.
        return not any(value is u or (type(value) is type(u) and value == u) for u in values)

    chosen = [n for n in names if is_set(n)]
    if len(chosen) > 1:
        values = ", ".join(f"{n}={getattr(obj, n)!r}" for n in chosen)
        raise section_error(
            obj, f"{' and '.join(chosen)} are mutually exclusive ({values}); set only one"
        )
