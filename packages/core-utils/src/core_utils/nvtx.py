"""NVTX ranges for Nsight profiles, switched on with :func:`configure_nvtx_profiling`.

Disabled (the default), every function here returns immediately. Enabled, ranges are
tracked on a stack so a pop must match its push (a mismatch raises, on CPU too, which lets
CPU tests catch unbalanced instrumentation), and, when CUDA is available, pushed to and
popped from ``torch.cuda.nvtx``. Without CUDA nothing is emitted: there is no profiler to
receive it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = [
    "configure_nvtx_profiling",
    "nvtx_decorator",
    "nvtx_range_pop",
    "nvtx_range_push",
]

_Wrapped = TypeVar("_Wrapped", bound=Callable[..., Any])

_nvtx_enabled: bool = False
_nvtx_range_messages: list[str] = []
# The first string object seen for a message is reused: profilers that keep the pointer
# (CUDA graph capture) need it to stay alive and identical.
_nvtx_range_msg_pool: dict[str, str] = {}


def configure_nvtx_profiling(enabled: bool) -> None:
    """Enable or disable NVTX ranges for the whole process."""
    global _nvtx_enabled
    _nvtx_enabled = bool(enabled)


def _emit() -> bool:
    return torch.cuda.is_available()


def _nvtx_range_get_func_path() -> str:
    """Return ``module.function`` of the caller of nvtx_range_push/pop (two frames up)."""
    frame = inspect.currentframe()
    caller = frame.f_back.f_back if frame and frame.f_back else None
    if caller is None:  # pragma: no cover - always called from push/pop
        return "<unknown>"
    module = inspect.getmodule(caller)
    module_name = module.__name__ if module else "<unknown>"
    return f"{module_name}.{caller.f_code.co_name}"


def _message(msg: str, suffix: str | None) -> str:
    if suffix is not None:
        msg = f"{msg}.{suffix}"
    return _nvtx_range_msg_pool.setdefault(msg, msg)


def nvtx_range_push(msg: str | None = None, suffix: str | None = None) -> None:
    """Open an NVTX range named ``msg`` (default: the calling function's ``module.name``).

    Args:
        msg: Range name.
        suffix: Appended as ``msg.suffix``.
    """
    if not _nvtx_enabled:
        return
    message = _message(_nvtx_range_get_func_path() if msg is None else msg, suffix)
    _nvtx_range_messages.append(message)
    if _emit():
        torch.cuda.nvtx.range_push(message)


def nvtx_range_pop(msg: str | None = None, suffix: str | None = None) -> None:
    """Close the innermost NVTX range, checking it is the one named ``msg``.

    Args:
        msg: Name of the range being closed (default: the calling function's path).
        suffix: Appended as ``msg.suffix``.

    Raises:
        RuntimeError: No range is open.
        ValueError: The innermost open range has a different name.
    """
    if not _nvtx_enabled:
        return
    message = _message(_nvtx_range_get_func_path() if msg is None else msg, suffix)
    if not _nvtx_range_messages:
        raise RuntimeError(f"nvtx_range_pop({message!r}): no NVTX range is open")
    last = _nvtx_range_messages.pop()
    if message != last:
        raise ValueError(
            f"nvtx_range_pop({message!r}) does not match the innermost open range {last!r}; "
            "pop ranges in reverse order of pushing"
        )
    if _emit():
        torch.cuda.nvtx.range_pop()


@functools.cache
def _nvtx_decorator_get_func_path(func: Callable[..., Any]) -> str:
    """Return ``module.qualname`` of ``func``."""
    module = inspect.getmodule(func)
    module_name = module.__name__ if module else getattr(func, "__module__", "<unknown>")
    return f"{module_name}.{func.__name__}"


def nvtx_decorator(
    message: str | None = None, color: str | None = None
) -> Callable[[_Wrapped], _Wrapped]:
    """Wrap every call of the decorated function in an NVTX range.

    Whether profiling is on is checked at call time, so decorating at import time and
    enabling later works.

    Args:
        message: Range name; default the function's ``module.name``.
        color: Accepted for compatibility; ``torch.cuda.nvtx`` ranges carry no colour.

    Returns:
        The decorator.
    """

    def decorator(func: _Wrapped) -> _Wrapped:
        name = message or _nvtx_decorator_get_func_path(func)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            nvtx_range_push(name)
            try:
                return func(*args, **kwargs)
            finally:
                nvtx_range_pop(name)

        return wrapper  # type: ignore[return-value]

    return decorator
