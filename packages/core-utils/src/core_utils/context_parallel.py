"""Split a batch along the sequence for context parallelism, load-balanced for causal masks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from core_utils._megatron import initialized_parallel_state

__all__ = ["get_batch_on_this_cp_rank"]


def _cp_size_and_rank(
    cp_group: dist.ProcessGroup | None, cp_size: int | None, cp_rank: int | None
) -> tuple[int, int]:
    if (cp_size is None) != (cp_rank is None):
        raise ValueError(
            "get_batch_on_this_cp_rank: give cp_size and cp_rank together "
            f"(got cp_size={cp_size}, cp_rank={cp_rank}), or pass cp_group="
        )
    if cp_size is not None and cp_rank is not None:
        size, rank = int(cp_size), int(cp_rank)
    elif cp_group is not None:
        size, rank = cp_group.size(), cp_group.rank()
    else:
        parallel_state = initialized_parallel_state()
        if parallel_state is None:
            return 1, 0
        size = parallel_state.get_context_parallel_world_size()
        rank = parallel_state.get_context_parallel_rank()
    if size < 1:
        raise ValueError(f"get_batch_on_this_cp_rank: cp_size must be >= 1, got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"get_batch_on_this_cp_rank: cp_rank must be in [0, {size}), got {rank}")
    return size, rank


def get_batch_on_this_cp_rank(
    batch: Mapping[str, Any],
    *,
    cp_group: dist.ProcessGroup | None = None,
    cp_size: int | None = None,
    cp_rank: int | None = None,
) -> dict[str, Any]:
    """Keep this context-parallel rank's part of every sequence in ``batch``.

    The sequence is cut into ``2 * cp_size`` equal chunks and rank ``r`` keeps chunks ``r``
    and ``2 * cp_size - 1 - r`` (in that order), so with a causal mask every rank gets the
    same amount of attention work. The sequence dimension is 2 for ``"attention_mask"``
    (``[b, 1, s, s]``: its query rows are split, key columns kept) and 1 for every other
    key (``[b, s, ...]``). ``None`` values, non-tensors and tensors without a sequence
    dimension pass through unchanged.

    The context-parallel layout comes from, in order: ``cp_size`` + ``cp_rank``,
    ``cp_group``, megatron's ``parallel_state`` when initialised; otherwise there is no
    context parallelism and the batch is returned as is.

    Args:
        batch: Mapping of names to tensors (``tokens``, ``labels``, ``loss_mask``,
            ``position_ids``, ``attention_mask``, ...).
        cp_group: Context-parallel process group.
        cp_size: Context-parallel size (with ``cp_rank``).
        cp_rank: This rank's index in the context-parallel group (with ``cp_size``).

    Returns:
        A new dict with the sliced tensors (the input mapping is not modified).

    Raises:
        ValueError: An inconsistent layout, or a sequence length not divisible by
            ``2 * cp_size`` (the message names the key).
    """
    size, rank = _cp_size_and_rank(cp_group, cp_size, cp_rank)
    result = dict(batch)
    if size == 1:
        return result
    chunks = 2 * size
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            continue
        seq_dim = 2 if key == "attention_mask" else 1
        if value.dim() <= seq_dim:
            continue
        seq_len = value.shape[seq_dim]
        if seq_len % chunks:
            raise ValueError(
                f"get_batch_on_this_cp_rank: batch[{key!r}] has sequence length {seq_len} "
                f"(dim {seq_dim}), not divisible by 2 * cp_size = {chunks}; pad the sequence "
                f"to a multiple of {chunks}"
            )
        chunked = value.view(
            *value.shape[:seq_dim], chunks, seq_len // chunks, *value.shape[seq_dim + 1 :]
        )
        index = torch.tensor([rank, chunks - 1 - rank], device=value.device)
        kept = chunked.index_select(seq_dim, index)
        result[key] = kept.reshape(*value.shape[:seq_dim], -1, *value.shape[seq_dim + 1 :])
    return result
