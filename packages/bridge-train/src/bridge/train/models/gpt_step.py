"""Forward step and loss for GPT pre-training batches.

A batch is a dict of ``[micro_batch_size, seq_length]`` tensors as megatron's
``GPTDataset`` / ``MockGPTDataset`` produce them: ``tokens``, ``labels``, ``loss_mask``,
``position_ids`` and optionally ``attention_mask`` (``[b, 1, s, s]``, ``True`` = masked).
A packed SFT batch also holds ``cu_seqlens``, ``cu_seqlens_count`` and ``max_seqlen``
(:mod:`bridge.train.data.packing`): a model built with the Transformer Engine layer spec
gets them as megatron's ``PackedSeqParams``; the portable spec reads the block-diagonal
attention mask instead.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from megatron.core.utils import get_model_config

from bridge.resiliency import StragglerTiming
from bridge.train.data.packing import PACKED_BATCH_KEYS, packed_seq_params
from bridge.train.state import GlobalState
from core_utils import Timers, get_batch_on_this_cp_rank

__all__ = ["forward_step", "get_batch", "masked_next_token_loss", "timed_forward"]

_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def _device_of(model: torch.nn.Module) -> torch.device:
    for param in model.parameters():
        return param.device
    return torch.device("cpu")


def get_batch(
    data_iterator: Iterator[dict[str, torch.Tensor]] | None, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor | None]:
    """Take the next micro-batch, move it to ``device`` and slice it for context parallelism.

    Args:
        data_iterator: Iterator over batch dicts.
        device: Device of the model.

    Returns:
        ``{"tokens", "labels", "loss_mask", "attention_mask", "position_ids"}`` (the
        attention mask may be ``None``), plus the packing keys of a packed batch. With
        context parallelism > 1 every sequence tensor holds this rank's part of the sequence
        (``core_utils.get_batch_on_this_cp_rank``).

    Raises:
        ValueError: No iterator, or the batch lacks a required key.
    """
    if data_iterator is None:
        raise ValueError("forward_step needs a data iterator on this rank, got None")
    raw = next(data_iterator)
    missing = [k for k in ("tokens", "labels", "loss_mask", "position_ids") if k not in raw]
    if missing:
        raise ValueError(f"GPT batch is missing {missing}; it has {sorted(raw)}")
    moved = {
        key: value.to(device, non_blocking=True)
        for key, value in raw.items()
        if key in (*_BATCH_KEYS, *PACKED_BATCH_KEYS) and isinstance(value, torch.Tensor)
    }
    batch: dict[str, torch.Tensor | None] = {key: moved.get(key) for key in _BATCH_KEYS}
    # Per-sample packing metadata: moved with the batch, never sliced along the sequence.
    packing = {key: moved[key] for key in PACKED_BATCH_KEYS if key in moved}
    batch = get_batch_on_this_cp_rank(batch)  # as it is without context parallelism
    batch.update(packing)
    return batch


def _reads_packed_seq_params(model: torch.nn.Module) -> bool:
    """Whether the model's attention takes ``PackedSeqParams`` (the Transformer Engine spec)."""

    resolve = getattr(get_model_config(model), "resolved_layer_spec_backend", None)
    return resolve is not None and resolve() == "transformer_engine"


def masked_next_token_loss(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Sum of per-token losses over unmasked tokens, in megatron's 3-tuple convention.

    Args:
        loss_mask: ``[b, s]``, 1 where the token counts.
        output_tensor: Per-token losses ``[b, s]`` from ``GPTModel(..., labels=...)``.

    Returns:
        ``(loss_sum, num_tokens, {"lm loss": tensor([loss_sum, num_tokens])})``. The schedule
        divides ``loss_sum`` by ``num_tokens`` and the number of micro-batches (or, with
        ``calculate_per_token_loss``, the gradients by the global token count); the training
        loop sums the reported pair over micro-batches and data-parallel ranks and divides.
    """
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.float().reshape(-1)
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().detach().to(torch.int)
    reported = torch.cat([loss.detach().view(1), num_tokens.view(1).to(loss.dtype)])
    return loss, num_tokens, {"lm loss": reported}


def timed_forward[BatchT](
    fetch: Callable[[], BatchT],
    run_model: Callable[[BatchT], torch.Tensor],
    *,
    timers: Timers | None,
    straggler: StragglerTiming | None,
) -> tuple[BatchT, torch.Tensor]:
    """Fetch a micro-batch and run the model on it, timed as the GPT and T5 steps time it:
    the fetch as ``batch-generator`` (with ``timers``), the fetch and the model's forward
    pass for the straggler report (with ``straggler``, inert when detection is off).

    Args:
        fetch: Takes the next micro-batch.
        run_model: Runs the model's forward pass on it.
        timers: The run's timers (``state.timers``), or ``None``.
        straggler: The run's straggler timing (``state.straggler_timing``), or ``None``.

    Returns:
        ``(batch, output)``.
    """
    if timers is not None:
        timers("batch-generator", log_level=2).start()
    with straggler.data() if straggler is not None else contextlib.nullcontext():
        batch = fetch()
    if timers is not None:
        timers("batch-generator").stop()
    # Straggler detection times the model's forward pass only (as megatron does): the
    # backward pass ends in gradient all-reduces where fast ranks wait for slow ones,
    # which would make every rank look equally slow.
    with straggler.step() if straggler is not None else contextlib.nullcontext():
        output = run_model(batch)
    return batch, output


def forward_step(
    state: GlobalState | None,
    data_iterator: Iterator[dict[str, torch.Tensor]] | None,
    model: torch.nn.Module,
    return_schedule_plan: bool = False,
) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    """One GPT forward pass on the next micro-batch.

    The ``state`` parameter makes the trainer inject its :class:`GlobalState` (see
    :func:`bridge.train.prepare_forward_step_func`); ``None`` is fine when calling it
    directly. Its timers and straggler timing time the step (:func:`timed_forward`).

    Args:
        state: The global state, or ``None``.
        data_iterator: Iterator over GPT batch dicts.
        model: The (wrapped) GPT model chunk.
        return_schedule_plan: Must be false (combined 1F1B schedule plans are not supported).

    Returns:
        ``(per_token_losses, loss_func)`` where ``loss_func(output)`` is
        :func:`masked_next_token_loss` bound to the batch's loss mask.

    Raises:
        NotImplementedError: ``return_schedule_plan`` is true.
    """
    if return_schedule_plan:
        raise NotImplementedError("forward_step: return_schedule_plan=True is not supported")

    def run_model(batch: dict[str, Any]) -> torch.Tensor:
        attention_mask = batch["attention_mask"]
        extra: dict[str, Any] = {}
        if batch.get("cu_seqlens") is not None and _reads_packed_seq_params(model):
            # Transformer Engine confines attention to each example through cu_seqlens.
            extra["packed_seq_params"] = packed_seq_params(batch)
            attention_mask = None
        return model(
            batch["tokens"],
            batch["position_ids"],
            attention_mask,
            labels=batch["labels"],
            loss_mask=batch["loss_mask"],
            **extra,
        )

    batch, output = timed_forward(
        lambda: get_batch(data_iterator, _device_of(model)),
        run_model,
        timers=getattr(state, "timers", None),
        straggler=getattr(state, "straggler_timing", None),
    )
    loss_mask = batch["loss_mask"]
    if loss_mask is None:  # get_batch guarantees it; a clear error if a subclass does not
        raise ValueError("forward_step: the batch has no loss_mask")
    return output, functools.partial(masked_next_token_loss, loss_mask)
