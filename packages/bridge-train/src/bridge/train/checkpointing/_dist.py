"""Rank helpers for checkpoint code that also runs without torch.distributed (internal)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def ready() -> bool:
    """Whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """Global rank (0 without a process group)."""
    return dist.get_rank() if ready() else 0


def world_size() -> int:
    """World size (1 without a process group)."""
    return dist.get_world_size() if ready() else 1


def barrier() -> None:
    """Wait for every rank (no-op without a process group)."""
    if ready():
        dist.barrier()


def broadcast_from_rank0(value: Any) -> Any:
    """Return rank 0's ``value`` on every rank (a picklable object)."""
    if not ready() or world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def run_on_rank0(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` on rank 0 and return its (picklable) result on every rank.

    An exception raised by ``fn`` on rank 0 is re-raised there, and on every other rank as
    a :class:`~bridge.train.checkpointing.errors.CheckpointError` with the same message, so
    no rank is left waiting in a collective.
    """
    from bridge.train.checkpointing.errors import CheckpointError

    error: Exception | None = None
    result: Any = None
    if rank() == 0:
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:
            error = exc
    shared = broadcast_from_rank0((error is None, result if error is None else str(error)))
    ok, payload = shared
    if ok:
        return payload
    if error is not None:
        raise error
    raise CheckpointError(payload)
