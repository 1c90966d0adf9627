"""Size, rank and source rank of a process group, safe without torch.distributed."""

from __future__ import annotations

import sys
import warnings
from types import ModuleType

import torch.distributed as dist

from core_utils._megatron import import_megatron
from core_utils.distributed import dist_ready

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
        check_initialized: Require megatron's default group when ``tp_group`` is None: raise
            if megatron's model parallelism is not initialised. When False, return ``None``
            in that case (and pass ``check_initialized=False`` to megatron's group getter).

    Returns:
        ``None`` when torch.distributed is not initialised (a single process has no
        tensor parallelism); ``tp_group`` when it is given; else megatron's default group
        (with a ``DeprecationWarning`` on rank 0: passing the group explicitly will be
        required), or ``None`` when that does not exist and ``check_initialized`` is False.

    Raises:
        RuntimeError: ``tp_group`` is None, ``check_initialized`` is True and megatron's
            model parallelism is not initialised.
        ImportError: ``tp_group`` is None, ``check_initialized`` is True and megatron-core,
            which owns the default group, is not installed.
    """
    if not dist_ready():
        return None
    if tp_group is not None:
        return tp_group
    caller = "get_tensor_model_parallel_group_if_none(tp_group=None)"
    parallel_state: ModuleType | None
    if check_initialized:
        parallel_state = import_megatron("megatron.core.parallel_state", caller)
    else:
        # Groups can only have been initialised by code that imported parallel_state:
        # a module that is not loaded means "no default group", without importing it.
        parallel_state = sys.modules.get("megatron.core.parallel_state")
        if parallel_state is None:
            return None
    if not parallel_state.is_initialized():
        if check_initialized:
            raise RuntimeError(
                f"{caller}: megatron's model parallelism is not initialised, so there is no "
                "default tensor-parallel group; call "
                "megatron.core.parallel_state.initialize_model_parallel(...) first or pass "
                "tp_group= explicitly (check_initialized=False returns None instead)"
            )
        return None
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
