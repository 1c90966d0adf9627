"""API-lifecycle decorators: no-op, deprecated, internal and experimental markers."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = [
    "deprecate_inference_params",
    "deprecated",
    "experimental_api",
    "internal_api",
    "null_decorator",
]

_Wrapped = TypeVar("_Wrapped", bound=Callable[..., Any])


def null_decorator(*args: Any, **kwargs: Any) -> Any:
    """A decorator that changes nothing, usable bare or with arguments.

    ``@null_decorator`` returns the function itself; ``@null_decorator(...)`` returns a
    decorator that returns the function itself. Useful as a stand-in for an optional
    decorator (``torch.compile``, ``jit_fuser``) that is unavailable.
    """
    if len(args) == 1 and not kwargs and callable(args[0]):
        return args[0]

    def identity(func: _Wrapped) -> _Wrapped:
        return func

    return identity


def deprecated(
    version: str,
    removal_version: str | None = None,
    alternative: str | None = None,
    reason: str | None = None,
) -> Callable[[_Wrapped], _Wrapped]:
    """Mark a function as deprecated.

    The decorated function warns with a ``DeprecationWarning`` on every call (the message
    gives the version, the removal version, the alternative and the reason when known) and
    carries the metadata as attributes: ``_deprecated`` (True), ``_deprecated_version``,
    ``_removal_version``, ``_alternative`` and ``_deprecation_reason``.

    Args:
        version: Version in which the deprecation starts, e.g. ``"1.0.0"``.
        removal_version: Version in which the function will be removed.
        alternative: Name of the replacement.
        reason: Why it is deprecated.

    Returns:
        The decorator.

    Raises:
        ValueError: ``version`` is empty.
    """
    if not isinstance(version, str) or not version.strip():
        raise ValueError(f"deprecated(version=...) needs a version string, got {version!r}")

    def decorator(func: _Wrapped) -> _Wrapped:
        parts = [f"{func.__qualname__} is deprecated since version {version}."]
        if alternative:
            parts.append(f"Use {alternative} instead.")
        if removal_version:
            parts.append(f"It will be removed in version {removal_version}.")
        if reason:
            parts.append(f"Reason: {reason}")
        message = " ".join(parts)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            warnings.warn(message, DeprecationWarning, stacklevel=2)
            return func(*args, **kwargs)

        metadata = {
            "_deprecated": True,
            "_deprecated_version": version,
            "_removal_version": removal_version,
            "_alternative": alternative,
            "_deprecation_reason": reason,
        }
        for target in (func, wrapper):
            for attr, value in metadata.items():
                setattr(target, attr, value)
        return wrapper  # type: ignore[return-value]

    return decorator


def internal_api[F: Callable[..., Any]](func: F) -> F:
    """Mark a function or class as internal (exempt from compatibility guarantees).

    Sets ``_internal_api = True`` on the object and returns it unchanged.
    """
    func._internal_api = True  # type: ignore[attr-defined]
    return func


def experimental_api[F: Callable[..., Any]](func: F) -> F:
    """Mark a function or class as experimental API (may change without notice).

    Sets ``_experimental_api = True`` on the object and returns it unchanged; unlike
    :func:`core_utils.experimental_fn` it does not gate calls behind the experimental flag.
    """
    func._experimental_api = True  # type: ignore[attr-defined]
    return func


def deprecate_inference_params(inference_context: Any, inference_params: Any) -> Any:
    """Return the inference context, accepting the old ``inference_params`` name.

    Args:
        inference_context: The new argument.
        inference_params: The deprecated argument; used (with a ``DeprecationWarning``)
            when ``inference_context`` is ``None``.

    Returns:
        ``inference_params`` if only it was given, else ``inference_context``.
    """
    if inference_context is None and inference_params is not None:
        warnings.warn(
            "`inference_params` is renamed to `inference_context`; pass inference_context=",
            DeprecationWarning,
            stacklevel=2,
        )
        return inference_params
    return inference_context
