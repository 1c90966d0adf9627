"""torch.distributed helpers that work with and without an initialised process group."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from core_utils.distributed import collective_device, global_rank, global_world_size
from core_utils.process_groups import get_pg_size


def is_last_rank() -> bool:
    """Whether this is the last rank, the one that owns the metric writers."""
    return global_rank() == global_world_size() - 1


def print_rank_last(message: str) -> None:
    """Print ``message`` (flushed) on the last rank only."""
    if is_last_rank():
        print(message, flush=True)


def _unwrap(module: Any) -> Iterable[Any]:
    """The module and every ``.module`` it wraps (DDP, Float16Module, ...)."""
    seen: set[int] = set()
    while module is not None and id(module) not in seen:
        seen.add(id(module))
        yield module
        module = getattr(module, "module", None)


def find_pg_collection(model: Any) -> Any:
    """The first ``pg_collection`` attribute found on a model chunk or a module it wraps.

    megatron-core models built with ``pg_collection=...`` keep it as an attribute; the
    wrappers around them (DDP, mixed-precision modules) expose the model as ``.module``.

    Args:
        model: A module or a list of model chunks.

    Returns:
        The process-group collection, or ``None`` when no chunk carries one.
    """
    chunks = model if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        for module in _unwrap(chunk):
            pg = getattr(module, "pg_collection", None)
            if pg is not None:
                return pg
    return None


def pg_attr(pg_collection: Any, name: str) -> Any:
    """``pg_collection.<name>`` or ``None`` when the collection or the group is missing."""
    if pg_collection is None:
        return None
    try:
        return getattr(pg_collection, name, None)
    except (AttributeError, AssertionError, RuntimeError):
        # Some collections raise instead of returning None for groups they do not hold.
        return None


def reduce_max_stat(stat: float | None, group: Any) -> float | None:
    """Maximum of ``stat`` over ``group``, where ranks holding ``None`` do not count.

    Used for the learning rate, which is ``None`` on ranks without trainable parameters.
    No reduction without an initialised group or with a group of one rank.

    Args:
        stat: This rank's value or ``None``.
        group: Process group to reduce over (``None``: no reduction).

    Returns:
        The maximum over the group, or ``None`` when every rank had ``None``.
    """
    if get_pg_size(group) == 1:  # also without a group or without torch.distributed
        return stat
    present = 0.0 if stat is None else 1.0
    value = -float("inf") if stat is None else float(stat)
    buf = torch.tensor([present, value], dtype=torch.float64)
    buf = buf.to(collective_device(group))
    # One MAX all-reduce: the flag says whether any rank had a value, the value is the max.
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
    any_present, best = buf.tolist()
    return best if any_present > 0 else None
