"""The error raised for every checkpoint problem a user can fix."""

from __future__ import annotations

from typing import Any

from core_utils.distributed import broadcast_from_rank0, global_rank

__all__ = ["CheckpointError", "run_on_rank0"]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded as configured.

    The message names the directory or key involved, what was found, and how to fix it.
    Raised consistently on every rank, so a distributed job fails instead of hanging.
    """


def run_on_rank0(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` on rank 0 and return its (picklable) result on every rank.

    An exception raised by ``fn`` on rank 0 is re-raised there, and on every other rank as
    a :class:`CheckpointError` with the same message, so no rank is left waiting in a
    collective.
    """
    error: Exception | None = None
    result: Any = None
    if global_rank() == 0:
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:
            error = exc
    ok, payload = broadcast_from_rank0((error is None, result if error is None else str(error)))
    if ok:
        return payload
    if error is not None:
        raise error
    raise CheckpointError(payload)
