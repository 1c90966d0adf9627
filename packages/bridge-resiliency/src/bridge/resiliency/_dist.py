"""torch.distributed helpers: agree on a few numbers across ranks.

Every function works without an initialised process group (one process: the values are
returned as they are), so the resiliency objects can be unit-tested and used in a
single-process run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from core_utils.distributed import collective_device, dist_ready


def all_reduce_max(values: Sequence[float]) -> list[float]:
    """Element-wise maximum of ``values`` over all ranks (a collective when distributed).

    float64 keeps elapsed seconds and 0/1 flags exact.
    """
    if not dist_ready() or dist.get_world_size() == 1:
        return [float(v) for v in values]
    tensor = torch.tensor(list(values), dtype=torch.float64, device=collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [float(v) for v in tensor.tolist()]


def broadcast_int(value: int, src: int = 0) -> int:
    """Return rank ``src``'s ``value`` on every rank (a collective when distributed)."""
    if not dist_ready() or dist.get_world_size() == 1:
        return int(value)
    tensor = torch.tensor([int(value)], dtype=torch.int64, device=collective_device())
    dist.broadcast(tensor, src=src)
    return int(tensor.item())
