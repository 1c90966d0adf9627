"""Forward step for T5 span-corruption batches (encoder-decoder, megatron ``T5Model``).

A batch is what :mod:`bridge.train.data.t5_datasets` (or megatron's
``T5MaskedWordPieceDataset``) yields: ``text_enc``, ``text_dec``, ``labels``, ``loss_mask``,
``enc_mask``, ``dec_mask``. The attention masks are built with megatron's own
``T5MaskedWordPieceDataset.config_attention_mask``: ``[b, 1, q, k]`` masks (``True`` = not
attended) for the encoder's self-attention, the decoder's causal self-attention and the
cross-attention.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset

from bridge.train.models.gpt_step import _device_of, masked_next_token_loss, timed_forward
from bridge.train.state import GlobalState

__all__ = ["t5_forward_step", "t5_get_batch"]

_KEYS = ("text_enc", "text_dec", "labels", "loss_mask", "enc_mask", "dec_mask")


def t5_get_batch(
    data_iterator: Iterator[dict[str, Any]] | None, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Take the next T5 micro-batch and move it to ``device``.

    Raises:
        ValueError: No iterator, or a key is missing.
    """
    if data_iterator is None:
        raise ValueError("t5_forward_step needs a data iterator on this rank, got None")
    raw = next(data_iterator)
    missing = [k for k in _KEYS if k not in raw]
    if missing:
        raise ValueError(f"T5 batch is missing {missing}; it has {sorted(raw)}")
    return {k: torch.as_tensor(raw[k]).to(device, non_blocking=True) for k in _KEYS}


def t5_forward_step(
    state: GlobalState | None,
    data_iterator: Iterator[dict[str, Any]] | None,
    model: torch.nn.Module,
) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    """One T5 forward pass on the next micro-batch.

    Args:
        state: The global state, or ``None``; its timers and straggler timing time the
            step as :func:`bridge.train.models.gpt_step.timed_forward` says.
        data_iterator: Iterator over T5 batch dicts.
        model: The (wrapped) ``T5Model``.

    Returns:
        ``(per_token_losses, loss_func)``; ``loss_func`` is
        :func:`bridge.train.models.gpt_step.masked_next_token_loss` bound to the decoder's loss mask.
    """

    def run_model(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # The 0/1 padding masks stand in for the tokens: megatron's builder treats ids >= 1
        # as real tokens, which would misread a real token with id 0.
        enc_mask, dec_mask, enc_dec_mask = T5MaskedWordPieceDataset.config_attention_mask(
            batch["enc_mask"],
            batch["dec_mask"],
            batch["enc_mask"],
            batch["dec_mask"],
            use_local=True,
        )
        return model(
            batch["text_enc"],
            batch["text_dec"],
            enc_mask,
            dec_mask,
            enc_dec_mask,
            lm_labels=batch["labels"],
        )

    batch, output = timed_forward(
        lambda: t5_get_batch(data_iterator, _device_of(model)),
        run_model,
        timers=getattr(state, "timers", None),
        straggler=getattr(state, "straggler_timing", None),
    )
    return output, functools.partial(masked_next_token_loss, batch["loss_mask"])
