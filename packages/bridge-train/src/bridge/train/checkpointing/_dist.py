"""Rank helpers for checkpoint code that also runs without torch.distributed (internal)."""

from __future__ import annotations

from typing import Any

from bridge.train.checkpointing.errors import CheckpointError

# The checkpoint code's names for core_utils' helpers: the process group's view only (a
# checkpoint records the layout it was saved under, never a launcher's guess).
from core_utils.distributed import (
    broadcast_from_rank0,
    dist_ready as ready,
    global_rank as rank,
    global_world_size as world_size,
)

__all__ = ["rank", "ready", "run_on_rank0", "world_size"]


def run_on_rank0(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` on rank 0 and return its (picklable) result on every rank.

    An exception raised by ``fn`` on rank 0 is re-raised there, and on every other rank as
    a :class:`~bridge.train.checkpointing.errors.CheckpointError` with the same message, so
    no rank is left waiting in a collective.
    """
    error: Exception | None = None
    result: Any = None
    if rank() == 0:
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
