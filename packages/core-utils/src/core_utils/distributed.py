"""torch.distributed helpers every distribution of the workspace shares.

Each one works without an initialised process group (a single process), so code that
calls them runs unchanged in a unit test, on a laptop and under ``torchrun``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_into",
    "any_rank",
    "broadcast_from_rank0",
    "collective_device",
    "dist_ready",
    "gather_from_every_rank",
    "global_rank",
    "global_world_size",
]


def dist_ready() -> bool:
    """Return whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def broadcast_from_rank0[T](value: T) -> T:
    """Rank 0's ``value`` (any picklable object) on every rank of the default group.

    Without a process group, or in a group of one, ``value`` is returned as it is. A
    collective: every rank of the group must call it.
    """
    if not dist_ready() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank of the default group (a MAX all-reduce), so that
    every rank takes the same decision.

    Without a process group, or in a group of one, ``flag``. A collective: every rank of
    the group must call it.
    """
    if not dist_ready() or dist.get_world_size() == 1:
        return bool(flag)
    value = torch.tensor([int(flag)], dtype=torch.int64, device=collective_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def gather_from_every_rank[T](value: T) -> list[T]:
    """Every rank's ``value`` (any picklable object), in rank order, on every rank of the
    default group.

    Without a process group, or in a group of one, ``[value]``. A collective: every rank of
    the group must call it.
    """
    if not dist_ready() or dist.get_world_size() == 1:
        return [value]
    everyone: list[T] = [value] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def _launcher_value(variable: str, default: int) -> int:
    raw = os.environ.get(variable)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"${variable}={raw!r} is not an integer; it is set by the launcher (torchrun): "
            f"unset it for a single process or launch with torchrun"
        ) from None


def global_rank(*, launcher_fallback: bool = False) -> int:
    """Return this process's rank in the default process group.

    Args:
        launcher_fallback: Before a process group exists, answer what the launcher set
            (``$RANK``, as torchrun sets it and as bridge-train exports it from
            ``SLURM_PROCID`` under ``srun``) instead of 0. For code that runs before
            ``init_process_group`` but must already act per rank.

    Returns:
        The rank; without a process group 0 (or ``$RANK`` with ``launcher_fallback``).

    Raises:
        ValueError: ``launcher_fallback`` and ``$RANK`` is not an integer.
    """
    if dist_ready():
        return int(dist.get_rank())
    return _launcher_value("RANK", 0) if launcher_fallback else 0


def global_world_size(*, launcher_fallback: bool = False) -> int:
    """Return the number of processes in the default process group.

    Args:
        launcher_fallback: Before a process group exists, answer what the launcher set
            (``$WORLD_SIZE``; under ``srun`` bridge-train exports it from
            ``SLURM_STEP_NUM_TASKS``) instead of 1.

    Returns:
        The world size; without a process group 1 (or ``$WORLD_SIZE`` with
        ``launcher_fallback``).

    Raises:
        ValueError: ``launcher_fallback`` and ``$WORLD_SIZE`` is not an integer.
    """
    if dist_ready():
        return int(dist.get_world_size())
    return _launcher_value("WORLD_SIZE", 1) if launcher_fallback else 1


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
