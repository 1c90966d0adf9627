"""Which model-config fields decide what a model computes, when two values agree, and how
a value is named in a message.

Shared by the resume check (:mod:`bridge.train.checkpointing.architecture`: a resumed
model must be the saved one) and the Hugging Face families
(:func:`bridge.train.models.families.match_family`: a provider leaves as the family that
reproduces it).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import PurePath
from typing import Any

__all__ = ["ARCHITECTURE_FIELDS", "same_setting", "show_setting"]

ARCHITECTURE_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "vocab_size",
    "gated_linear_unit",
    "activation_func",
    "normalization",
    "layernorm_epsilon",
    "layernorm_zero_centered_gamma",
    "add_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "share_embeddings_and_output_weights",
    "position_embedding_type",
    "rotary_base",
    "rotary_base_local",
    "rotary_percent",
    "rope_scaling",
    "rope_scaling_factor",
    "seq_len_interpolation_factor",
    "window_size",
    "window_attn_skip_freq",
    "softmax_scale",
    "softmax_type",
    "activation_func_clamp_value",
    "glu_linear_offset",
    "multi_latent_attention",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "rope_type",
    "rotary_scaling_factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "yarn_rotary_scaling_factor",
    "yarn_original_max_position_embeddings",
    "yarn_beta_fast",
    "yarn_beta_slow",
    "yarn_mscale",
    "yarn_mscale_all_dim",
    "yarn_correction_range_round_to_int",
    "num_moe_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_layer_freq",
    "moe_router_pre_softmax",
    "moe_router_score_function",
    "moe_router_topk_scaling_factor",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_enable_expert_bias",
    "moe_shared_expert_intermediate_size",
    "moe_router_dtype",
    "apply_residual_connection_post_layernorm",
    "hybrid_override_pattern",
)
"""Model-config fields that change what the model computes (fields a model class does not
have are skipped by the comparisons). The vocabulary padding is not one of them: it
changes the tables' shape, not the model."""


def _callable_key(value: Callable[..., Any]) -> Any:
    if isinstance(value, functools.partial):
        return (_callable_key(value.func), value.args, tuple(sorted(value.keywords.items())))
    return (getattr(value, "__module__", None), getattr(value, "__qualname__", repr(value)))


def same_setting(a: Any, b: Any) -> bool:
    """Whether two provider field values mean the same (callables by what they call,
    sequences by their items, numbers by value, a path as its string)."""
    if callable(a) and callable(b):
        return bool(_callable_key(a) == _callable_key(b))
    if isinstance(a, PurePath) or isinstance(b, PurePath):
        return str(a) == str(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        # Values that went through a config.json (x ** -0.5 and back) differ in the last bit.
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_setting(x, y) for x, y in zip(a, b, strict=True))
    try:
        return bool(a == b)
    except Exception:  # tensors and other objects without a boolean equality
        return a is b


def show_setting(value: Any) -> str:
    """A provider field value as a message names it: a function or class by its qualified
    name (``silu``, ``LayerNorm``), anything else by its ``repr``."""
    name = getattr(value, "__qualname__", None)
    return name if callable(value) and name else repr(value)
