"""Size, rank and source rank of a process group, safe without torch.distributed."""

from __future__ import annotations

import warnings

import torch.distributed as dist

from core_utils._distributed import dist_ready
from core_utils._megatron import import_megatron

__all__ = [
    "get_pg_rank",
    "get_pg_size",
    "get_pg_src_rank",
    "get_tensor_model_parallel_group_if_none",
]


def get_pg_size(group: dist.ProcessGroup | None = None) -> int:
    """Return the number of ranks in ``group``.

    Returns:
        ``group.size()``; 1 when torch.distributed is not initialised or ``group`` is
        ``None`` (no group means no parallelism along that dimension).
    """
    if not dist_ready() or group is None:
        return 1
    return int(group.size())


def get_pg_rank(group: dist.ProcessGroup | None = None) -> int:
    """Return this process's rank within ``group``.

    Returns:
        ``group.rank()``; 0 when torch.distributed is not initialised or ``group`` is ``None``.
    """
    if not dist_ready() or group is None:
        return 0
    return int(group.rank())


def get_pg_src_rank(group: dist.ProcessGroup | None = None) -> int:
    """Return the global rank of ``group``'s first member (its broadcast source).

    Returns:
        The lowest-indexed member's global rank; 0 when torch.distributed is not initialised
        or ``group`` is ``None``.
    """
    if not dist_ready() or group is None:
        return 0
    return int(dist.get_process_group_ranks(group)[0])


def get_tensor_model_parallel_group_if_none(
    tp_group: dist.ProcessGroup | None,
    is_expert: bool = False,
    check_initialized: bool = True,
) -> dist.ProcessGroup | None:
    """Return ``tp_group``, or megatron's default (expert) tensor-parallel group if it is None.

    Args:
        tp_group: The tensor-parallel group to use; returned unchanged when given.
        is_expert: Fall back to the expert tensor-parallel group instead.
        check_initialized: Passed to megatron's group getter (raise if the group is unset).

    Returns:
        ``None`` when torch.distributed is not initialised; ``tp_group`` when it is given or
        megatron's model parallelism is not initialised; else the default group (with a
        ``DeprecationWarning`` on rank 0: passing the group explicitly will be required).

    Raises:
        ImportError: ``tp_group`` is None under torch.distributed and megatron-core, which
            owns the default group, is not installed.
    """
    if not dist_ready():
        return None
    if tp_group is not None:
        return tp_group
    parallel_state = import_megatron(
        "megatron.core.parallel_state", "get_tensor_model_parallel_group_if_none(tp_group=None)"
    )
    if not parallel_state.is_initialized():
        return tp_group
    if dist.get_rank() == 0:
        warnings.warn(
            "tp_group is None, using megatron's default tensor-parallel group; "
            "pass tp_group explicitly",
            DeprecationWarning,
            stacklevel=2,
        )
    if is_expert:
        return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
    return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)
