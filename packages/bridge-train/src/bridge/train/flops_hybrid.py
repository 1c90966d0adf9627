"""Model FLOPs of one training step of a hybrid Mamba model (megatron-LM's formulas).

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

from typing import Any

__all__ = ["hybrid_floating_point_operations"]


def hybrid_floating_point_operations(
    model: Any, batch_size: int, seq_length: int, padded_vocab: int
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
