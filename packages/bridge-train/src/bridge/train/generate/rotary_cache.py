"""Keys enter the KV cache already rotated: :func:`rotate_keys_before_caching`.

megatron-core 0.19.2's static-batch inference path (``Attention._adjust_key_value_for_inference``
without ``flash_decode``) stores keys in the KV cache *before* rotary embedding, then
returns the whole cache with ``k_pos_emb[:sequence_end]`` so that ``Attention.forward``
rotates every cached key again at every step: per layer and step, work (and a ``cos``/``sin``
of the whole prefix) that grows with the sequence. Rotating once, before caching, is what
megatron does itself with ``flash_decode``; that path does not run here: its decode step
calls flash-attention's ``flash_attn_with_kvcache`` (CUDA), and without flash-attention
installed its ``apply_rotary_pos_emb_with_cos_sin`` fallback takes ``cos``/``sin`` of the
already computed cosines and sines (``rope_utils._apply_rotary_pos_emb_bshd`` treats its
input as angles), so it rotates by the wrong angles.

So, for the duration of a generation, each attention module's
``_adjust_key_value_for_inference`` first rotates the new queries and keys with the same
``apply_rotary_pos_emb`` and the same rows of the rotary embedding that ``Attention.forward``
would use for them, lets megatron's method cache the rotated keys, and hands back no rotary
embedding, so ``Attention.forward`` rotates nothing again. RoPE is applied element-wise per
position, so every cached key holds the values the old path recomputed at every step: the
attention inputs, hence the logits, are the same bit for bit.

The layers of a model share one ``cos``/``sin`` computation per step and rotary table
(:class:`_StepRotations`).
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.attention import Attention
from megatron.core.transformer.multi_latent_attention import MultiLatentAttention
from megatron.core.utils import deprecate_inference_params

__all__ = ["caches_rotated_keys", "rotate_keys_before_caching"]


class _StepRotations:
    """Rotates the queries and keys of one forward step, every layer with the same angles.

    megatron's unfused ``apply_rotary_pos_emb`` takes ``cos`` and ``sin`` of the angles (and
    scales and casts them) for every tensor it rotates: twice per layer and step, the same
    values each time. Here they are computed once per step, rotary table (Gemma 3's local and
    global layers have one each), scale and dtype, with megatron's expressions, and applied
    with megatron's formula ``t * cos + rotate_half(t) * sin`` (non-interleaved), so every
    rotated value is the same bit for bit. Interleaved or fused rotary embeddings and a rotary
    dimension narrower than the head go through megatron's function as before.
    """

    def __init__(self) -> None:
        self.step: tuple[Any, int, int] | None = None
        # Object ids are safe keys: each entry holds the table it was made from.
        self.angles: dict[tuple[int, torch.dtype, float, int], tuple[Any, ...]] = {}

    def __call__(
        self,
        attention: Attention,
        inference_context: Any,
        freqs: torch.Tensor | None,
        start: int,
        end: int,
        t: torch.Tensor,
    ) -> torch.Tensor:
        if freqs is None:
            return t
        step = self.step
        if step is None or step[0] is not inference_context or step[1:] != (start, end):
            self.step = (inference_context, start, end)
            self.angles = {}
        config, mscale = attention.config, attention._yarn_concentration_factor
        key = (id(freqs), t.dtype, float(mscale), id(config))
        entry = self.angles.get(key)
        if entry is None:
            padding = getattr(inference_context, "left_padding", None)
            if padding is None:  # the step's tokens: megatron's own slice of q_pos_emb
                rows = freqs[start:end]
            else:
                # Left-padded rows (the generator's padding slots before each row's prompt):
                # row r's token in slot i rotates by its position i - left_padding[r] in its
                # own prompt ([s, b, 1, dim] rows of the [max_s, 1, 1, dim] embedding).
                slots = torch.arange(start, end, device=padding.device)
                rows = freqs[:, 0][(slots[:, None] - padding[None, :]).clamp(min=0)]
            cos_sin = None
            if not (config.apply_rope_fusion or config.rotary_interleaved):
                # megatron's _apply_rotary_pos_emb_bshd, expression for expression.
                cos_sin = (
                    (torch.cos(rows) * mscale).to(t.dtype),
                    (torch.sin(rows) * mscale).to(t.dtype),
                )
            entry = self.angles[key] = (freqs, rows, cos_sin)
        _, rows, cos_sin = entry
        if cos_sin is None or rows.shape[-1] != t.shape[-1]:
            return apply_rotary_pos_emb(
                t, rows, config=config, mscale=mscale, cp_group=attention.pg_collection.cp
            )
        cos, sin = cos_sin
        first, second = torch.chunk(t, 2, dim=-1)
        return t * cos + torch.cat((-second, first), dim=-1) * sin


def _adjust_rotated(
    self: Attention,
    inference_context: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    rotary_pos_emb: Any,
    *args: Any,
    rotations: _StepRotations,
    inference_params: Any = None,
    **kwargs: Any,
) -> Any:
    """megatron's ``_adjust_key_value_for_inference`` on rotated queries and keys."""
    inference_context = deprecate_inference_params(inference_context, inference_params)
    if (
        inference_context is not None
        and inference_context.is_static_batching()
        and rotary_pos_emb is not None
        and not self.config.flash_decode
    ):
        start = inference_context.sequence_len_offset
        end = start + key.size(0)
        query = rotations(self, inference_context, rotary_pos_emb[0], start, end, query)
        key = rotations(self, inference_context, rotary_pos_emb[1], start, end, key)
        rotary_pos_emb = None
    return Attention._adjust_key_value_for_inference(
        self, inference_context, query, key, value, rotary_pos_emb, *args, **kwargs
    )


def _eligible(module: torch.nn.Module) -> bool:
    # Multi-latent attention rotates its own positional part before caching; a class that
    # overrides the method has its own idea of the cache.
    return (
        isinstance(module, Attention)
        and not isinstance(module, MultiLatentAttention)
        and type(module)._adjust_key_value_for_inference
        is Attention._adjust_key_value_for_inference
    )


def caches_rotated_keys(model: torch.nn.Module) -> bool:
    """Whether :func:`rotate_keys_before_caching` switches every attention layer of
    ``model`` (then each token's rotary position can follow a left-padded row's own
    positions; multi-latent attention rotates by slot)."""
    return all(_eligible(m) for m in model.modules() if isinstance(m, Attention))


@contextlib.contextmanager
def rotate_keys_before_caching(model: torch.nn.Module) -> Iterator[int]:
    """Within the block, ``model``'s attention layers cache rotated keys (module docstring).

    Only the modules' instance attribute changes; it is removed on exit, whatever happens,
    so the model trains and runs a plain forward exactly as before.

    Args:
        model: The model (any ``torch.nn.Module`` holding megatron attention layers).

    Yields:
        The number of attention layers switched (0: nothing to do, e.g. multi-latent
        attention or no attention layer at all).
    """
    switched = [module for module in model.modules() if _eligible(module)]
    adjust = functools.partial(_adjust_rotated, rotations=_StepRotations())
    for module in switched:
        # An instance attribute shadows the class's method for this module only.
        object.__setattr__(
            module, "_adjust_key_value_for_inference", types.MethodType(adjust, module)
        )
    try:
        yield len(switched)
    finally:
        for module in switched:
            module.__dict__.pop("_adjust_key_value_for_inference", None)
