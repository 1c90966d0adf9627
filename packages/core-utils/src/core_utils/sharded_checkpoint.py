"""Build megatron-core ``ShardedTensor`` s for distributed checkpoints.

These need megatron-core (``pip install megatron-core``); it is imported when they are
called, never when ``core_utils`` is imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from core_utils._megatron import import_megatron
from core_utils.dtensor import _is_dtensor, get_full_tensor_if_necessary
from core_utils.process_groups import get_pg_rank, get_pg_size

__all__ = ["make_sharded_tensor_for_checkpoint", "make_tp_sharded_tensor_for_checkpoint"]


def _groups(
    tp_group: dist.ProcessGroup | None, dp_cp_group: dist.ProcessGroup | None, caller: str
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    if tp_group is None and dp_cp_group is None:
        parallel_state = import_megatron("megatron.core.parallel_state", caller)
        if parallel_state.model_parallel_is_initialized():
            tp_group = parallel_state.get_tensor_model_parallel_group()
            dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return tp_group, dp_cp_group


def _sharded_tensor_class(caller: str) -> Any:
    return import_megatron("megatron.core.dist_checkpointing.mapping", caller).ShardedTensor


def make_tp_sharded_tensor_for_checkpoint(
    tensor: torch.Tensor,
    key: str,
    tp_axis: int = 0,
    replica_id: Any = None,
    prepend_offsets: Sequence[tuple[int, int, int]] = (),
    **kwargs: Any,
) -> Any:
    """Return a ``ShardedTensor`` for a tensor split along ``tp_axis`` over tensor parallelism.

    Args:
        tensor: This rank's shard.
        key: Checkpoint key of the full tensor.
        tp_axis: Axis split across the tensor-parallel group.
        replica_id: Replica id; default ``(0, 0, dp_rank)`` (DP rank 0 writes).
        prepend_offsets: ``(axis, rank_offset, fragments)`` tuples for extra leading axes.
        **kwargs: ``tp_group`` and ``dp_cp_group`` (default: megatron's ``parallel_state``
            groups when initialised, else none), the rest passed to
            ``ShardedTensor.from_rank_offsets``.

    Raises:
        ImportError: megatron-core is not installed.
    """
    caller = "make_tp_sharded_tensor_for_checkpoint"
    sharded_tensor_cls = _sharded_tensor_class(caller)
    tp_group, dp_cp_group = _groups(
        kwargs.pop("tp_group", None), kwargs.pop("dp_cp_group", None), caller
    )
    prepend_axis_num = len(prepend_offsets)
    tp_rank, tp_size = get_pg_rank(tp_group), get_pg_size(tp_group)
    dp_rank, dp_size = get_pg_rank(dp_cp_group), get_pg_size(dp_cp_group)
    offsets = [(tp_axis + prepend_axis_num, tp_rank, tp_size)]
    dp_replica_id = dp_rank
    is_fsdp2 = hasattr(tensor, "is_torch_fsdp2_param") and _is_dtensor(tensor)
    if is_fsdp2:
        # FSDP2 shards dim 0 across DP: every DP shard is a main replica.
        dp_replica_id = 0
        tensor = tensor._local_tensor  # type: ignore[attr-defined]
        if tp_axis == 0:
            offsets[0] = (prepend_axis_num, tp_rank * dp_size + dp_rank, tp_size * dp_size)
        else:
            offsets.append((prepend_axis_num, dp_rank, dp_size))
    if replica_id is None:
        replica_id = (0, 0, dp_replica_id)
    sharded = sharded_tensor_cls.from_rank_offsets(
        key,
        tensor,
        *prepend_offsets,
        *offsets,
        replica_id=replica_id,
        prepend_axis_num=prepend_axis_num,
        **kwargs,
    )
    if is_fsdp2:
        sharded.is_torch_fsdp2_param = True
    return sharded


def make_sharded_tensor_for_checkpoint(
    tensor: torch.Tensor,
    key: str,
    prepend_offsets: Sequence[tuple[int, int, int]] = (),
    replica_id: Any = None,
    **kwargs: Any,
) -> Any:
    """Return a ``ShardedTensor`` for a tensor replicated across tensor and data parallelism.

    Args:
        tensor: The (full) tensor.
        key: Checkpoint key.
        prepend_offsets: ``(axis, rank_offset, fragments)`` tuples for extra leading axes.
        replica_id: Replica id; default ``(0, tp_rank, dp_rank)`` (only TP rank 0 of DP rank
            0 writes).
        **kwargs: ``tp_group`` and ``dp_cp_group`` (default: megatron's ``parallel_state``
            groups when initialised, else none), the rest passed to
            ``ShardedTensor.from_rank_offsets``.

    Raises:
        ImportError: megatron-core is not installed.
    """
    caller = "make_sharded_tensor_for_checkpoint"
    sharded_tensor_cls = _sharded_tensor_class(caller)
    tp_group, dp_cp_group = _groups(
        kwargs.pop("tp_group", None), kwargs.pop("dp_cp_group", None), caller
    )
    prepend_axis_num = len(prepend_offsets)
    dp_rank, dp_size = get_pg_rank(dp_cp_group), get_pg_size(dp_cp_group)
    offsets: list[tuple[int, int, int]] = []
    dp_replica_id = dp_rank
    is_fsdp2 = hasattr(tensor, "is_torch_fsdp2_param") and _is_dtensor(tensor)
    if is_fsdp2:
        dp_replica_id = 0
        tensor = get_full_tensor_if_necessary(tensor)
        offsets.append((prepend_axis_num, dp_rank, dp_size))
    if replica_id is None:
        replica_id = (0, get_pg_rank(tp_group), dp_replica_id)
    sharded = sharded_tensor_cls.from_rank_offsets(
        key,
        tensor,
        *prepend_offsets,
        *offsets,
        replica_id=replica_id,
        prepend_axis_num=prepend_axis_num,
        **kwargs,
    )
    if is_fsdp2:
        sharded.is_torch_fsdp2_param = True
    return sharded
