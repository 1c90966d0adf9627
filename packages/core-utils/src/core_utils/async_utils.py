"""asyncio helpers: a process-wide event loop and exception tracing for background tasks."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import Any

__all__ = ["get_asyncio_loop", "trace_async_exceptions"]

logger = logging.getLogger(__name__)

_ASYNC_IO_LOOP: asyncio.AbstractEventLoop | None = None
# qualified name -> [completed calls, total milliseconds]
_ASYNC_TASK_STATS: defaultdict[str, list[float]] = defaultdict(lambda: [0, 0.0])


def get_asyncio_loop(loop: asyncio.AbstractEventLoop | None = None) -> asyncio.AbstractEventLoop:
    """Return ``loop``, else the running loop, else one process-wide loop (created once).

    The created loop is also set as the current thread's event loop.
    """
    global _ASYNC_IO_LOOP
    if loop is not None:
        return loop
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        pass
    if _ASYNC_IO_LOOP is None or _ASYNC_IO_LOOP.is_closed():
        _ASYNC_IO_LOOP = asyncio.new_event_loop()
        asyncio.set_event_loop(_ASYNC_IO_LOOP)
    return _ASYNC_IO_LOOP


def _record(name: str, start: float) -> None:
    elapsed_ms = (time.perf_counter() - start) * 1000.0
    stats = _ASYNC_TASK_STATS[name]
    stats[0] += 1
    stats[1] += elapsed_ms
    count = int(stats[0])
    # Log the 1st, 10th, 100th, ... completion: lifetime stats without flooding the log.
    if math.log10(count).is_integer():
        logger.info(
            "%s completed in %.3f ms, lifetime avg: %.3f ms, lifetime cnt: %d",
            name,
            elapsed_ms,
            stats[1] / count,
            count,
        )


def trace_async_exceptions(func: Callable[..., Any] | None = None, *, verbose: bool = False) -> Any:
    """Make exceptions of a coroutine (or async generator) run as a task visible.

    An exception in a task nobody awaits is otherwise reported late (at garbage collection)
    or never. The decorated coroutine logs any exception with its traceback at ERROR level
    the moment it happens, naming the function, then re-raises it (so an awaiting caller
    still sees it). Cancellation is not an error and passes through silently.

    Usable bare (``@trace_async_exceptions``) or with options
    (``@trace_async_exceptions(verbose=True)``).

    Args:
        func: The coroutine function or async generator function.
        verbose: Also log completion time and lifetime average at the 1st, 10th, 100th, ...
            completion.

    Raises:
        TypeError: ``func`` is not a coroutine function or async generator function.
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        name = getattr(fn, "__qualname__", repr(fn))
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def coroutine_wrapper(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return await fn(*args, **kwargs)
                except Exception:
                    logger.exception("exception in async function %s", name)
                    raise
                finally:
                    if verbose:
                        _record(name, start)

            return coroutine_wrapper
        if inspect.isasyncgenfunction(fn):

            @functools.wraps(fn)
            async def generator_wrapper(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
                start = time.perf_counter()
                try:
                    async for item in fn(*args, **kwargs):
                        yield item
                except Exception:
                    logger.exception("exception in async generator %s", name)
                    raise
                finally:
                    if verbose:
                        _record(name, start)

            return generator_wrapper
        raise TypeError(
            f"trace_async_exceptions decorates async functions or async generators, "
            f"got {name} ({type(fn).__name__})"
        )

    return decorate if func is None else decorate(func)
