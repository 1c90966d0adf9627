"""Range and consistency checks shared by the sections' ``__post_init__`` methods."""

from __future__ import annotations

from typing import Any

from bridge.config._errors import field_error, section_error


def at_least(obj: Any, name: str, minimum: float, *, allow_none: bool = True) -> None:
    """Require ``obj.<name> >= minimum`` (``None`` passes when ``allow_none``)."""
    value = getattr(obj, name)
    if value is None:
        if allow_none:
            return
        raise field_error(obj, name, value, f"it is required (a number >= {minimum})")
    if value < minimum:
        what = "a positive integer" if minimum == 1 else f"a value >= {minimum}"
        raise field_error(obj, name, value, f"expected {what}")


def greater_than(obj: Any, name: str, bound: float, *, allow_none: bool = True) -> None:
    """Require ``obj.<name> > bound`` (``None`` passes when ``allow_none``)."""
    value = getattr(obj, name)
    if value is None and allow_none:
        return
    if value is None or value <= bound:
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


def at_most_one(obj: Any, *names: str, unset: tuple[Any, ...] = (None,)) -> None:
    """Require that at most one of the named fields holds a value other than ``unset``."""
    chosen = [n for n in names if getattr(obj, n) not in unset]
    if len(chosen) > 1:
        values = ", ".join(f"{n}={getattr(obj, n)!r}" for n in chosen)
        raise section_error(
            obj, f"{' and '.join(chosen)} are mutually exclusive ({values}); set only one"
        )
