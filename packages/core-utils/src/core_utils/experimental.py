"""Gate experimental code behind an explicit opt-in.

Experimental functions and classes (decorated with :func:`experimental_fn` /
:func:`experimental_cls`) raise :class:`ExperimentalNotEnabledError` when used, unless
experimental mode is on. Turn it on either way:

* in code: ``core_utils.set_experimental_enabled(True)`` (bridge-train's distributed
  setup calls this for ``dist.enable_megatron_core_experimental=true``);
* in the environment: ``CORE_UTILS_EXPERIMENTAL=1`` (also ``true``, ``yes``, ``on``),
  read again every time the flag is queried (a change applies at the next call).

The setter wins over the environment once called. The check happens at call time, so
decorating at import time and enabling later works.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from packaging.version import InvalidVersion, Version

from core_utils.log_utils import log_single_rank

__all__ = [
    "ENV_VAR",
    "ExperimentalNotEnabledError",
    "experimental_cls",
    "experimental_fn",
    "is_experimental_enabled",
    "set_experimental_enabled",
]

ENV_VAR = "CORE_UTILS_EXPERIMENTAL"
_TRUE = frozenset({"1", "true", "yes", "on"})
# Minor releases an experimental API may live before a warning says it is past its life.
_MAX_LIFETIME_MINORS = 3

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_explicit: bool | None = None
_announced: set[str] = set()

_T = TypeVar("_T")


class ExperimentalNotEnabledError(Exception):
    """Experimental code was called while experimental mode is off."""


def set_experimental_enabled(enabled: bool) -> None:
    """Turn experimental mode on or off for this process (overrides the environment).

    Raises:
        TypeError: ``enabled`` is not a bool.
    """
    global _explicit
    if not isinstance(enabled, bool):
        raise TypeError(f"set_experimental_enabled(enabled=...) takes a bool, got {enabled!r}")
    with _lock:
        _explicit = enabled


def is_experimental_enabled() -> bool:
    """Return whether experimental mode is on (setter first, then ``CORE_UTILS_EXPERIMENTAL``)."""
    if _explicit is not None:
        return _explicit
    return os.environ.get(ENV_VAR, "").strip().lower() in _TRUE


def _not_enabled(name: str, introduced_with_version: str) -> ExperimentalNotEnabledError:
    return ExperimentalNotEnabledError(
        f"{name} is experimental (introduced in {introduced_with_version}) and experimental "
        f"mode is off; enable it with core_utils.set_experimental_enabled(True) or "
        f"{ENV_VAR}=1"
    )


def _check(name: str, introduced_with_version: str) -> None:
    if not is_experimental_enabled():
        raise _not_enabled(name, introduced_with_version)
    if name not in _announced:
        _announced.add(name)
        log_single_rank(logger, logging.INFO, "running experimental code: %s", name)


def _package_version() -> Version | None:
    try:
        return Version(importlib.metadata.version("core-utils"))
    except (importlib.metadata.PackageNotFoundError, InvalidVersion):
        return None


def _validate(introduced_with_version: str, name: str, decorator: str) -> None:
    try:
        introduced = Version(str(introduced_with_version))
    except InvalidVersion as exc:
        raise ValueError(
            f"{decorator}(introduced_with_version={introduced_with_version!r}) on {name}: "
            "not a valid version string (e.g. '0.1.0')"
        ) from exc
    current = _package_version()
    if (
        current is not None
        and current.major == introduced.major
        and introduced.minor + _MAX_LIFETIME_MINORS < current.minor
    ):
        log_single_rank(
            logger,
            logging.WARNING,
            "%s has been experimental since %s and has reached end of life; "
            "productionize or remove it",
            name,
            introduced,
        )


def experimental_fn(introduced_with_version: str) -> Callable[[_T], _T]:
    """Mark a function as experimental: calls raise unless experimental mode is on.

    Args:
        introduced_with_version: Version that introduced the function, e.g. ``"0.1.0"``.

    Returns:
        A decorator. The decorated function carries ``_experimental_api = True`` and
        ``_introduced_with_version``.

    Raises:
        ValueError: ``introduced_with_version`` is not a version string (at decoration).
        ExperimentalNotEnabledError: (from the decorated function) experimental mode is off.
    """

    def decorator(func: _T) -> _T:
        name = getattr(func, "__qualname__", repr(func))
        _validate(introduced_with_version, name, "experimental_fn")

        @functools.wraps(func)  # type: ignore[arg-type]
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            _check(name, introduced_with_version)
            return func(*args, **kwargs)  # type: ignore[operator]

        wrapper._experimental_api = True  # type: ignore[attr-defined]
        wrapper._introduced_with_version = introduced_with_version  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorator


def _guard_callable(func: Callable[..., Any], name: str, version: str) -> Callable[..., Any]:
    @functools.wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _check(name, version)
        return func(*args, **kwargs)

    return guarded


def experimental_cls(introduced_with_version: str) -> Callable[[type[_T]], type[_T]]:
    """Mark a class as experimental: instantiating it, or calling its static or class
    methods, raises unless experimental mode is on.

    The class is modified in place (its ``__init__`` and the static/class methods it
    defines are guarded), so ``isinstance`` and subclassing behave as usual. The class
    attribute ``is_experimental`` tells whether experimental mode is currently on.

    Args:
        introduced_with_version: Version that introduced the class, e.g. ``"0.1.0"``.

    Returns:
        A decorator returning the same class.

    Raises:
        ValueError: ``introduced_with_version`` is not a version string (at decoration).
        ExperimentalNotEnabledError: (on use) experimental mode is off.
    """

    def decorator(cls: type[_T]) -> type[_T]:
        name = cls.__qualname__
        _validate(introduced_with_version, name, "experimental_cls")
        original_init = cls.__init__

        @functools.wraps(original_init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            # Subclasses share the gate: check the flag once per construction.
            _check(name, introduced_with_version)
            original_init(self, *args, **kwargs)

        cls.__init__ = __init__  # type: ignore[method-assign]
        for attr, value in list(vars(cls).items()):
            if isinstance(value, staticmethod):
                guarded = _guard_callable(value.__func__, f"{name}.{attr}", introduced_with_version)
                setattr(cls, attr, staticmethod(guarded))
            elif isinstance(value, classmethod):
                guarded = _guard_callable(value.__func__, f"{name}.{attr}", introduced_with_version)
                setattr(cls, attr, classmethod(guarded))
        cls.is_experimental = _ExperimentalFlag()  # type: ignore[attr-defined]
        cls._experimental_api = True  # type: ignore[attr-defined]
        cls._introduced_with_version = introduced_with_version  # type: ignore[attr-defined]
        return cls

    return decorator


class _ExperimentalFlag:
    """Descriptor: reads the current experimental flag on class and instance access."""

    def __get__(self, instance: object, owner: type | None = None) -> bool:
        return is_experimental_enabled()
