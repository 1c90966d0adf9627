"""Model FLOPs of one training step of a GPT model (for throughput and MFU logging).

What is counted: the matrix multiplications of the forward pass, at 2 FLOPs per
multiply-accumulate, times 3 for forward plus backward (the backward pass computes a data
gradient and a weight gradient of the same size as each forward GEMM). Per token and layer:

* attention: the QKV projection ``h x (q + 2 kv)`` with ``q = kv_channels x heads`` and
  ``kv = kv_channels x query_groups`` (grouped-query attention shrinks K and V), the output
  projection ``q x h``, and the two score/value matmuls. With a causal mask each query
  attends to ``s / 2`` keys on average, so the two matmuls together cost ``q x s`` (this
  halving is how Megatron-Bridge counts it). Multi-latent attention (DeepSeek-V3) counts
  its projections instead: the query's down ``h x q_lora`` and up ``q_lora x heads x (nope +
  rope)`` (or one ``h x heads x (nope + rope)`` without ``q_lora_rank``), the key/value
  down ``h x (kv_lora + rope)`` and up ``kv_lora x heads x (nope + v)``, the output
  ``heads x v x h``, and the score and value matmuls with their own head widths
  (``heads x (nope + rope) x s / 2`` and ``heads x v x s / 2``);
* MLP: ``h x ffn`` per projection, with 3 projections for gated linear units (SwiGLU) and 2
  otherwise; MoE layers count ``moe_router_topk`` routed experts of ``moe_ffn_hidden_size``
  plus the shared experts (``moe_layer_freq`` decides which layers are MoE);
* multi-token prediction layers count as extra layers plus their projection;
* the logits: ``h x padded_vocab_size`` per token (per MTP depth as well).

Not counted: embeddings lookups, normalisation, softmax, activation functions, the router,
dropout, the loss. The count is independent of the parallel layout: it is the work of the
whole model for ``batch_size`` sequences.
"""

from __future__ import annotations

from megatron.core.transformer import TransformerConfig

from bridge.train.metrics.flops_models import (
    hybrid_floating_point_operations,
    t5_floating_point_operations,
)
from bridge.train.models.gpt_provider import calculate_padded_vocab_size
from bridge.train.models.mamba_provider import MambaProvider
from bridge.train.models.t5_provider import T5ModelProvider

__all__ = ["num_floating_point_operations"]


def _moe_layer_pattern(model: TransformerConfig) -> list[int]:
    freq = getattr(model, "moe_layer_freq", 1)
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"model.moe_layer_freq must be >= 1, got {freq}")
        return [1 if i % freq == 0 else 0 for i in range(model.num_layers)]
    if isinstance(freq, (list, tuple)):
        if len(freq) != model.num_layers:
            raise ValueError(
                f"model.moe_layer_freq has {len(freq)} entries but model.num_layers="
                f"{model.num_layers}"
            )
        return [int(x) for x in freq]
    raise ValueError(f"model.moe_layer_freq must be an int or a list, got {freq!r}")


def _latent_attention_macs(model: TransformerConfig, s: int) -> float:
    """Per-token forward multiply-accumulates of one multi-latent attention layer."""
    h, heads = model.hidden_size, model.num_attention_heads
    qk_width = heads * (model.qk_head_dim + model.qk_pos_emb_head_dim)
    v_width = heads * model.v_head_dim
    if model.q_lora_rank is None:
        query = h * qk_width
    else:
        query = h * model.q_lora_rank + model.q_lora_rank * qk_width
    key_value = h * (model.kv_lora_rank + model.qk_pos_emb_head_dim) + model.kv_lora_rank * (
        heads * model.qk_head_dim + v_width
    )
    # causal: each query sees s / 2 keys on average
    return query + key_value + v_width * h + (qk_width + v_width) * s / 2


def num_floating_point_operations(
    model_config: TransformerConfig, batch_size: int, seq_length: int | None = None
) -> float:
    """Training FLOPs (forward + backward) of one step over ``batch_size`` sequences.

    Args:
        model_config: The model config (a ``GPTModelProvider`` / ``TransformerConfig`` with
            ``seq_length``, ``vocab_size``, ``make_vocab_size_divisible_by``), or a config
            container with a ``model`` attribute.
        batch_size: Number of sequences (usually the global batch size).
        seq_length: Sequence length; defaults to ``model_config.seq_length``.

    Returns:
        The FLOP count as a float (see the module docstring for what is counted).

    Raises:
        ValueError: A size is missing or not positive.
    """
    model = getattr(model_config, "model", model_config)
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    s = seq_length if seq_length is not None else getattr(model, "seq_length", None)
    if not s or s < 1:
        raise ValueError(f"sequence length must be a positive integer, got {s!r}")
    if getattr(model, "vocab_size", None) is None:
        raise ValueError("model.vocab_size must be set to count the logit FLOPs")
    if isinstance(model, T5ModelProvider):
        return t5_floating_point_operations(model, batch_size, model.padded_vocab_size)
    if isinstance(model, MambaProvider):
        return hybrid_floating_point_operations(model, batch_size, s, model.padded_vocab_size)
    h = model.hidden_size
    heads = model.num_attention_heads
    kv_channels = model.kv_channels or h // heads
    groups = model.num_query_groups or heads
    ffn = model.ffn_hidden_size or 4 * h
    q_size = kv_channels * heads
    kv_size = kv_channels * groups
    padded_vocab = calculate_padded_vocab_size(
        model.vocab_size,
        getattr(model, "make_vocab_size_divisible_by", 1),
        getattr(model, "tensor_model_parallel_size", 1),
    )
    if not getattr(model, "should_pad_vocab", True):
        padded_vocab = model.vocab_size

    mtp_layers = getattr(model, "mtp_num_layers", None) or 0
    moe = getattr(model, "num_moe_experts", None) is not None
    pattern = _moe_layer_pattern(model) if moe else [0] * model.num_layers
    pattern += [pattern[-1] if moe else 0] * mtp_layers  # MTP layers: like the last layer
    num_layers, num_moe_layers = len(pattern), sum(pattern)
    num_dense_layers = num_layers - num_moe_layers
    routed_experts = getattr(model, "moe_router_topk", 1) if moe else 0

    projections = 3 if getattr(model, "gated_linear_unit", False) else 2
    moe_ffn = getattr(model, "moe_ffn_hidden_size", None) or ffn
    shared_ffn = getattr(model, "moe_shared_expert_intermediate_size", None) or 0

    # Per-token forward multiply-accumulates; x2 FLOPs per MAC, x3 for fwd + bwd below.
    mlp_macs = h * (
        ffn * projections * num_dense_layers
        + (moe_ffn * routed_experts + shared_ffn) * projections * num_moe_layers
    )
    if getattr(model, "multi_latent_attention", False):
        attention_macs = num_layers * _latent_attention_macs(model, s)
    else:
        attention_macs = num_layers * (
            h * (q_size + 2 * kv_size)  # QKV projection
            + q_size * h  # output projection
            + q_size * s  # QK^T and attention x V, causal: s / 2 keys each
        )
    mtp_macs = mtp_layers * (
        1.5 * h + h * h
    )  # eh norms (counted as Megatron-Bridge does) + eh projection
    logit_macs = h * padded_vocab * (mtp_layers + 1)
    per_token = 3 * 2 * (mlp_macs + attention_macs + mtp_macs + logit_macs)
    return float(batch_size * s * per_token)
