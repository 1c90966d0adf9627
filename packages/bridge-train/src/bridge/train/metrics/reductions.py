"""Reductions of per-rank scalars over a model-parallel group."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from core_utils.distributed import collective_device

__all__ = ["logical_and_across_model_parallel_group", "reduce_max_stat_across_model_parallel_group"]


def reduce_max_stat_across_model_parallel_group(stat: float | None, mp_group: Any) -> float | None:
    """Maximum of ``stat`` over ``mp_group``; ranks without the stat pass ``None``.

    Args:
        stat: The value on this rank, or ``None`` when this rank has none (for example the
            gradient norm on a rank that holds no optimizer).
        mp_group: The process group to reduce over (typically ``pg_collection.mp``).

    Returns:
        The maximum over the ranks that have a value, or ``None`` when no rank has one.
        Values must be >= 0 (norms, counts): a negative value is treated as missing.
    """
    value = -1.0 if stat is None else float(stat)
    tensor = torch.tensor([value], dtype=torch.float64, device=collective_device(mp_group))
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=mp_group)
    result = float(tensor.item())
    return None if result < 0 else result


def logical_and_across_model_parallel_group(input: bool, mp_group: Any) -> bool:
    """Logical AND of ``input`` over ``mp_group``.

    Args:
        input: This rank's boolean.
        mp_group: The process group to reduce over (typically ``pg_collection.mp``).

    Returns:
        True only if ``input`` is true on every rank of the group.
    """
    tensor = torch.tensor([int(input)], dtype=torch.int32, device=collective_device(mp_group))
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=mp_group)
    return bool(tensor.item())
