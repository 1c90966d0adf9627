"""Provider fields of routed-expert MLPs (shared by the mixture-of-experts families).

megatron-core's MoE layer (its router and ``SequentialMLP`` experts, ``moe_grouped_gemm``
off so it runs on CPU too) with softmax routing: top-k of the logits then a softmax over
the k chosen (``moe_router_pre_softmax=False``) equals Hugging Face's softmax over all
experts, top-k, renormalised (``norm_topk_prob``); without renormalisation megatron takes
the softmax over all experts first (``moe_router_pre_softmax=True``). Dropless (no capacity
factor), as Hugging Face computes.
"""

from __future__ import annotations

from typing import Any

from bridge.train.models.families.config_fields import refuse, require

__all__ = ["expert_count", "hf_moe_layers", "moe_layer_pattern", "routed_moe_kwargs"]


def expert_count(config: dict[str, Any], field: str, model: str) -> int:
    """The routed experts of ``config``: ``field``, else ``num_local_experts`` (the
    transformers >= 5 spelling); refused when there are none."""
    experts = config.get(field, config.get("num_local_experts"))
    if not experts:
        raise refuse(config, field, experts, f"a {model} model needs experts")
    return int(experts)


def moe_layer_pattern(num_layers: int, moe_layers: set[int]) -> int | list[int]:
    """megatron's ``moe_layer_freq``: ``1`` when every layer has experts, else a 0/1 list."""
    if moe_layers == set(range(num_layers)):
        return 1
    return [1 if layer in moe_layers else 0 for layer in range(num_layers)]


def hf_moe_layers(provider: Any) -> list[int]:
    """Indices of the provider's expert layers (from ``moe_layer_freq``)."""
    freq = provider.moe_layer_freq
    if isinstance(freq, int):
        return [i for i in range(provider.num_layers) if i % freq == 0]
    return [i for i, flag in enumerate(freq) if flag]


def routed_moe_kwargs(
    config: dict[str, Any],
    expert_ffn: int,
    *,
    experts: int | None = None,
    normalize: bool = True,
    pattern: int | list[int] = 1,
) -> dict[str, Any]:
    """The MoE provider fields (see the module docstring) of ``config``: ``experts``
    (default ``num_local_experts``) of width ``expert_ffn``, ``num_experts_per_tok`` chosen,
    on the layers of ``pattern``; ``router_aux_loss_coef`` is the load-balancing
    coefficient."""
    return {
        "num_moe_experts": experts or int(require(config, "num_local_experts")),
        "moe_router_topk": int(require(config, "num_experts_per_tok")),
        "moe_ffn_hidden_size": expert_ffn,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not normalize,
        "moe_layer_freq": pattern,
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": float(config.get("router_aux_loss_coef", 0.0) or 0.0),
        "moe_grouped_gemm": False,
    }
