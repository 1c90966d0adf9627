"""Small torch.distributed helpers shared by the modules of core-utils."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_gather_into", "collective_device", "dist_ready"]


def dist_ready() -> bool:
    """Return whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Return the device a collective on ``group`` needs its tensors on.

    CPU for gloo (also in a mixed ``"cpu:gloo,cuda:nccl"`` group), the current CUDA device
    for an nccl-only group.
    """
    if not dist_ready():
        return torch.device("cpu")
    backend = str(dist.get_backend(group))
    if "gloo" not in backend and "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_into(
    output: torch.Tensor,
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """All-gather ``tensor`` from every rank into ``output`` concatenated along dim 0.

    Uses ``all_gather_single`` where torch has it (``all_gather_into_tensor`` is deprecated
    there) and ``all_gather_into_tensor`` otherwise.
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work: dist.Work | None = gather(output, tensor, group=group, async_op=async_op)
    return work
