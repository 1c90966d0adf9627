"""Helpers that accept a torch ``DTensor`` or a plain tensor alike."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "get_data_parallel_group_if_dtensor",
    "get_full_tensor_if_necessary",
    "to_local_if_dtensor",
]


def _dtensor_class() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return DTensor


def _is_dtensor(tensor: Any) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(tensor, cls)


def get_full_tensor_if_necessary(tensor: Any) -> torch.Tensor:
    """Return the local shard of a DTensor, or the full tensor if some rank's shard is empty.

    When a mesh dimension has more ranks than the sharded tensor dimension has elements,
    some ranks hold an empty shard; the full (replicated) tensor is returned then, so every
    rank has data (a collective in that case). Plain tensors are returned unchanged.
    """
    if not _is_dtensor(tensor):
        return tensor
    from torch.distributed.tensor import Shard

    mesh = tensor.device_mesh
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Shard) and mesh.shape[mesh_dim] > tensor.shape[placement.dim]:
            full: torch.Tensor = tensor.full_tensor()
            return full
    local: torch.Tensor = tensor._local_tensor
    return local


def to_local_if_dtensor(tensor: Any) -> torch.Tensor:
    """Return the local shard of a DTensor (without autograd history), or ``tensor`` itself."""
    if not _is_dtensor(tensor):
        return tensor
    with torch.no_grad():
        local: torch.Tensor = tensor.to_local()
        return local


def get_data_parallel_group_if_dtensor(
    tensor: Any, data_parallel_group: dist.ProcessGroup | None = None
) -> dist.ProcessGroup | None:
    """Return the process group of a DTensor's (1-D) device mesh, or ``None`` for a tensor.

    Args:
        tensor: A DTensor or a plain tensor.
        data_parallel_group: The group the caller expects; checked against the mesh's.

    Raises:
        ValueError: ``data_parallel_group`` is given and is not the DTensor's group.
    """
    if not _is_dtensor(tensor):
        return None
    group: dist.ProcessGroup = tensor.device_mesh.get_group()
    if data_parallel_group is not None and group != data_parallel_group:
        raise ValueError(
            "get_data_parallel_group_if_dtensor: the DTensor's mesh group (ranks "
            f"{dist.get_process_group_ranks(group)}) is not data_parallel_group (ranks "
            f"{dist.get_process_group_ranks(data_parallel_group)})"
        )
    return group
