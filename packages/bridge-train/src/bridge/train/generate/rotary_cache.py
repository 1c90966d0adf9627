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

megatron's unfused rotation takes ``cos``/``sin`` of its angles for each tensor it rotates,
twice per layer and step, the same values every time; here the layers of a model share one
computation per step and rotary table (:class:`_StepRotation`, megatron's expressions and
formula, so again the same values bit for bit).
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.attention import Attention
from megatron.core.transformer.multi_latent_attention import MultiLatentAttention
from megatron.core.utils import deprecate_inference_params

__all__ = ["LeftPaddedStaticContext", "caches_rotated_keys", "rotate_keys_before_caching"]


class LeftPaddedStaticContext(StaticInferenceContext):
    """megatron's ``StaticInferenceContext`` for prompts of different lengths left-padded to
    the longest, so that one prefill covers them all.

    Args:
        max_batch_size: Rows of the KV cache.
        max_sequence_length: Slots of the KV cache (longest prompt + new tokens).
        left_padding: ``[batch]`` long tensor: padding slots before each row's prompt. Row
            ``r``'s token in slot ``i`` is at position ``i - left_padding[r]`` of its prompt
            (what its rotary embedding and learned position embedding use).
    """

    def __init__(
        self, max_batch_size: int, max_sequence_length: int, left_padding: torch.Tensor
    ) -> None:
        super().__init__(max_batch_size, max_sequence_length)
        self.left_padding = left_padding


def _step_positions(
    inference_context: Any, pos_emb: torch.Tensor | None, start: int, end: int
) -> torch.Tensor | None:
    """The rows of ``pos_emb`` for the tokens of this step."""
    if pos_emb is None:
        return None
    padding = getattr(inference_context, "left_padding", None)
    if padding is None:
        # The positions of the tokens in this step: megatron's own slice of q_pos_emb.
        return pos_emb[start:end]
    # Left-padded rows: each token rotates by its position in its own prompt, not by its
    # slot ([s, b, 1, dim] rows of the [max_s, 1, 1, dim] embedding).
    slots = torch.arange(start, end, device=padding.device)
    positions = (slots[:, None] - padding[None, :]).clamp(min=0)
    return pos_emb[:, 0][positions]


class _StepRotation:
    """Rotates the queries and keys of one forward step, every layer with the same angles.

    megatron's unfused ``apply_rotary_pos_emb`` takes ``cos`` and ``sin`` of the angles (and
    scales and casts them) for every tensor it rotates: twice per layer and step, the same
    values each time. Here they are computed once per step and rotary embedding, with
    megatron's expressions, and applied with megatron's formula
    ``t * cos + rotate_half(t) * sin`` (non-interleaved), so every rotated value is the same
    bit for bit. Interleaved or fused rotary embeddings, a rotary dimension narrower than
    the head and another dtype go through megatron's function as before.
    """

    def __init__(
        self,
        attention: Attention,
        inference_context: Any,
        rotary_pos_emb: tuple[Any, Any],
        start: int,
        end: int,
        dtype: torch.dtype,
    ) -> None:
        self.rotary_pos_emb = rotary_pos_emb  # held, so the ids in the step's key stay valid
        self.mscale = attention._yarn_concentration_factor
        self.config = attention.config
        self.cp_group = attention.pg_collection.cp
        q_freqs = _step_positions(inference_context, rotary_pos_emb[0], start, end)
        shared = rotary_pos_emb[0] is rotary_pos_emb[1]
        k_freqs = (
            q_freqs if shared else _step_positions(inference_context, rotary_pos_emb[1], start, end)
        )
        self.freqs = (q_freqs, k_freqs)
        self.dtype = dtype
        own = not (self.config.apply_rope_fusion or self.config.rotary_interleaved)
        q_cos_sin = self._cos_sin(q_freqs) if own and q_freqs is not None else None
        k_cos_sin = (
            q_cos_sin
            if shared
            else (self._cos_sin(k_freqs) if own and k_freqs is not None else None)
        )
        self.cos_sin = (q_cos_sin, k_cos_sin)

    def _cos_sin(self, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # megatron's _apply_rotary_pos_emb_bshd, expression for expression.
        return (
            (torch.cos(freqs) * self.mscale).to(self.dtype),
            (torch.sin(freqs) * self.mscale).to(self.dtype),
        )

    def __call__(self, t: torch.Tensor, which: int) -> torch.Tensor:
        freqs = self.freqs[which]
        if freqs is None:
            return t
        cos_sin = self.cos_sin[which]
        if cos_sin is None or freqs.shape[-1] != t.shape[-1] or t.dtype != self.dtype:
            return apply_rotary_pos_emb(
                t, freqs, config=self.config, mscale=self.mscale, cp_group=self.cp_group
            )
        cos, sin = cos_sin
        first, second = torch.chunk(t, 2, dim=-1)
        return t * cos + torch.cat((-second, first), dim=-1) * sin


class _StepRotations:
    """The :class:`_StepRotation` objects of the current forward step, shared by the attention
    layers of one model: made by the first layer that needs one, dropped when the step (or
    the inference context) moves on. Layers with a rotary table of their own (Gemma 3's
    local and global ones) get one each."""

    def __init__(self) -> None:
        self.step: tuple[Any, int, int] | None = None
        self.rotations: dict[tuple[int, int, torch.dtype, float, int], _StepRotation] = {}

    def get(
        self,
        attention: Attention,
        inference_context: Any,
        rotary_pos_emb: Any,
        start: int,
        end: int,
        dtype: torch.dtype,
    ) -> _StepRotation:
        step = self.step
        if step is None or step[0] is not inference_context or step[1:] != (start, end):
            self.step = (inference_context, start, end)
            self.rotations = {}
        # Object ids are safe keys: each rotation holds the objects it was made from.
        key = (
            id(rotary_pos_emb[0]),
            id(rotary_pos_emb[1]),
            dtype,
            float(attention._yarn_concentration_factor),
            id(attention.config),
        )
        rotation = self.rotations.get(key)
        if rotation is None:
            rotation = _StepRotation(
                attention, inference_context, rotary_pos_emb, start, end, dtype
            )
            self.rotations[key] = rotation
        return rotation


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
        rotate = rotations.get(self, inference_context, rotary_pos_emb, start, end, query.dtype)
        query = rotate(query, 0)
        key = rotate(key, 1)
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
