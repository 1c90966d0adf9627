"""The step's loss reduction and gradient zeroing, shared by the trainer, evaluation and the
benchmark baseline loop.

Losses follow megatron's report convention: each micro-batch reports
``{name: tensor([value_sum, count])}`` (or a per-micro-batch average); the reduced loss is
the token-weighted average over micro-batches and data-parallel ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from core_utils.distributed import collective_device

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer

__all__ = ["reduce_loss_dicts", "reduce_losses", "sum_loss_pairs", "zero_grad_buffers"]


def sum_loss_pairs(
    loss_dicts: list[dict[str, torch.Tensor]], group: Any
) -> dict[str, torch.Tensor]:
    """``{name: tensor([value_sum, count])}`` (float64, on the losses' device) summed over
    micro-batches and, with ``group``, over its ranks (one all-reduce for all names)."""
    totals: dict[str, torch.Tensor] = {}
    for entry in loss_dicts:
        for name, value in entry.items():
            pair = value.detach().to(torch.float64).reshape(-1)
            if pair.numel() == 1:  # (loss, dict) convention: a per-micro-batch average
                pair = torch.cat([pair, pair.new_ones(1)])
            totals[name] = totals[name] + pair if name in totals else pair
    if group is not None and dist.is_initialized() and totals:
        names = sorted(totals)
        stacked = torch.stack([totals[name] for name in names]).to(collective_device(group))
        dist.all_reduce(stacked, group=group)
        totals = {name: stacked[i] for i, name in enumerate(names)}
    return totals


def reduce_losses(
    loss_dicts: list[dict[str, torch.Tensor]], group: Any = None
) -> dict[str, torch.Tensor]:
    """Token-averaged losses of megatron-style ``{name: tensor([value_sum, count])}`` reports,
    kept on the device (no host synchronisation).

    Args:
        loss_dicts: What ``forward_backward_func`` returned on this rank.
        group: Data-parallel (x context-parallel) group to sum over; ``None`` = no reduction.

    Returns:
        ``{name: value_sum / max(count, 1)}`` as 0-d float64 tensors.
    """
    return {
        name: pair[0] / pair[1].clamp(min=1.0)
        for name, pair in sum_loss_pairs(loss_dicts, group).items()
    }


def reduce_loss_dicts(
    loss_dicts: list[dict[str, torch.Tensor]], group: Any = None
) -> dict[str, tuple[float, float]]:
    """Sum megatron-style ``{name: tensor([value_sum, count])}`` reports over micro-batches and ranks.

    Args:
        loss_dicts: What ``forward_backward_func`` returned on this rank.
        group: Data-parallel (x context-parallel) group to sum over; ``None`` = no reduction.

    Returns:
        ``{name: (value_sum, count)}``; the averaged loss is ``value_sum / count``.
    """
    return {
        name: (float(pair[0]), float(pair[1]))
        for name, pair in sum_loss_pairs(loss_dicts, group).items()
    }


def zero_grad_buffers(model: list[torch.nn.Module], optimizer: MegatronOptimizer) -> None:
    """Zero the gradients before a step: the DDP wrappers' buffers and the optimizer's."""
    for chunk in model:
        zero = getattr(chunk, "zero_grad_buffer", None)
        if zero is not None:
            zero()
    optimizer.zero_grad()
