"""Model FLOPs of one training step of hybrid Mamba and T5 models.

Megatron-LM counts a hybrid model per layer kind, forward only, and multiplies by 3 for
forward + backward:

* Mamba-2 layer: ``in_proj`` ``2 b s h (2 d_in + 2 groups d_state + heads)``, the scan
  ``7 b s d_in d_state``, ``out_proj`` ``2 b s d_in h``;
* attention layer: ``4 b s h p (h + h groups / heads + s / 2)`` with
  ``p = kv_channels heads / h`` (causal: half the score matrix);
* MLP layer: ``4 (ffn / h) b s h^2``, times 3/2 for gated linear units;
* logits: ``2 b s h padded_vocab``.

``d_in`` is the mixer width actually built (``mamba_num_heads x mamba_head_dim``, or
``2 h``); megatron-LM always uses ``2 h``, which is the same unless ``mamba_num_heads`` is
set to something else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bridge.train.models.mamba_provider import MambaProvider
    from bridge.train.models.t5_provider import T5ModelProvider

__all__ = ["hybrid_floating_point_operations", "t5_floating_point_operations"]


def hybrid_floating_point_operations(
    model: MambaProvider, batch_size: int, seq_length: int, padded_vocab: int
) -> float:
    """Training FLOPs of a hybrid model (a ``MambaProvider``) for ``batch_size`` sequences.

    Args:
        model: The provider (``layer_pattern``, ``mamba_*`` sizes, attention sizes).
        batch_size: Number of sequences.
        seq_length: Sequence length.
        padded_vocab: Padded vocabulary size of the output layer.

    Returns:
        The FLOP count.

    Raises:
        ValueError: The pattern holds a layer kind this count does not cover (MoE, MLA,
            DSA, GDN).
    """
    pattern = model.layer_pattern.split("/")[0].replace("|", "")
    other = sorted(set(pattern) - set("M*-"))
    if other:
        raise ValueError(
            f"the FLOP count covers Mamba (M), attention (*) and MLP (-) layers; "
            f"model.hybrid_override_pattern also has {other}"
        )
    b, s, h = batch_size, seq_length, model.hidden_size
    heads = model.num_attention_heads
    kv_channels = model.kv_channels or h // heads
    groups = model.num_query_groups or heads
    ffn = model.ffn_hidden_size or 4 * h
    gated = 1.5 if getattr(model, "gated_linear_unit", False) else 1.0

    m_heads = model.mamba_heads
    d_in = m_heads * model.mamba_head_dim
    d_state, m_groups = model.mamba_state_dim, model.mamba_num_groups
    mamba = (
        2 * b * s * h * (2 * d_in + 2 * m_groups * d_state + m_heads)
        + 7 * b * s * d_in * d_state
        + 2 * b * s * d_in * h
    )
    p = kv_channels * heads / h
    attention = 4 * b * s * h * p * (h + h * groups / heads + s / 2)
    mlp = 4 * (ffn / h) * gated * b * s * h * h
    logits = 2 * b * s * h * padded_vocab
    forward = (
        pattern.count("M") * mamba
        + pattern.count("*") * attention
        + pattern.count("-") * mlp
        + logits
    )
    return float(3 * forward)


def t5_floating_point_operations(
    model: T5ModelProvider, batch_size: int, padded_vocab: int
) -> float:
    """Training FLOPs of a T5 model (a ``T5ModelProvider``) for ``batch_size`` samples.

    megatron-LM has no T5-specific count; this one applies its per-layer conventions to an
    encoder-decoder: encoder layers attend to all ``s_enc`` keys (no causal halving),
    decoder self-attention is causal (``s_dec / 2``), decoder cross-attention projects Q and
    the output on ``s_dec`` tokens and K, V on ``s_enc`` tokens and scores all ``s_enc``
    keys; MLPs as above; logits on ``s_dec`` tokens; times 3 for forward + backward.

    Args:
        model: The provider (``seq_length`` encoder, ``seq_length_dec`` decoder).
        batch_size: Number of samples.
        padded_vocab: Padded vocabulary size.

    Returns:
        The FLOP count.
    """
    b, h = batch_size, model.hidden_size
    s_enc, s_dec = model.seq_length, model.seq_length_dec
    heads = model.num_attention_heads
    q = (model.kv_channels or h // heads) * heads
    kv = (model.kv_channels or h // heads) * (model.num_query_groups or heads)
    ffn = model.ffn_hidden_size or 4 * h
    gated = 1.5 if getattr(model, "gated_linear_unit", False) else 1.0

    def mlp(tokens: int) -> float:
        return 4 * gated * b * tokens * h * ffn

    def self_attention(tokens: int, keys: float) -> float:
        projections = 2 * b * tokens * h * (q + 2 * kv) + 2 * b * tokens * q * h
        return projections + 4 * b * tokens * q * keys

    cross = (
        2 * b * s_dec * h * q  # Q
        + 2 * b * s_enc * h * 2 * q  # K, V (one head per query head)
        + 2 * b * s_dec * q * h  # output projection
        + 4 * b * s_dec * q * s_enc  # scores and weighted values over all encoder keys
    )
    encoder = model.encoder_layers * (self_attention(s_enc, s_enc) + mlp(s_enc))
    decoder = model.num_layers * (self_attention(s_dec, s_dec / 2) + cross + mlp(s_dec))
    logits = 2 * b * s_dec * h * padded_vocab
    return float(3 * (encoder + decoder + logits))
