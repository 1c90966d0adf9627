"""torch.distributed helpers: which rank am I, and agree on a few numbers across ranks.

Every function works without an initialised process group (one process: the values are
returned as they are), so the resiliency objects can be unit-tested and used in a
single-process run.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist


def dist_ready() -> bool:
    """Return whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def current_rank() -> int:
    """Global rank from torch.distributed, else ``$RANK``, else 0."""
    if dist_ready():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def current_world_size() -> int:
    """World size from torch.distributed, else ``$WORLD_SIZE``, else 1."""
    if dist_ready():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _device() -> torch.device:
    # gloo (alone or mixed "cpu:gloo,cuda:nccl") reduces CPU tensors; nccl needs CUDA ones.
    backend = str(dist.get_backend())
    if "gloo" not in backend and "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_max(values: Sequence[float]) -> list[float]:
    """Element-wise maximum of ``values`` over all ranks (a collective when distributed).

    float64 keeps elapsed seconds and 0/1 flags exact.
    """
    if not dist_ready() or dist.get_world_size() == 1:
        return [float(v) for v in values]
    tensor = torch.tensor(list(values), dtype=torch.float64, device=_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [float(v) for v in tensor.tolist()]


def broadcast_int(value: int, src: int = 0) -> int:
    """Return rank ``src``'s ``value`` on every rank (a collective when distributed)."""
    if not dist_ready() or dist.get_world_size() == 1:
        return int(value)
    tensor = torch.tensor([int(value)], dtype=torch.int64, device=_device())
    dist.broadcast(tensor, src=src)
    return int(tensor.item())
