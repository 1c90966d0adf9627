"""``qwen3_moe`` (Qwen3-MoE): Qwen3 attention (QK-norm) with routed experts.

Experts: ``num_experts`` (``num_local_experts`` in transformers >= 5 configs), top
``num_experts_per_tok`` by softmax, renormalised when ``norm_topk_prob`` (see
:mod:`bridge.train.models.families.moe`), each a SwiGLU MLP of ``moe_intermediate_size``.
Layer ``i`` has experts unless it is in ``mlp_only_layers`` or ``(i + 1)`` is not a
multiple of ``decoder_sparse_step``; the others are dense SwiGLU MLPs of
``intermediate_size`` (megatron's ``moe_layer_freq`` list). ``router_aux_loss_coef``
becomes megatron's load-balancing coefficient (``moe_aux_loss_coeff``, ``aux_loss``).
Refused as for Qwen3 (attention bias, sliding windows) and ``hidden_act`` other than SiLU.
"""

from __future__ import annotations

from typing import Any

from bridge.train.models.families.base import register_family
from bridge.train.models.families.config_fields import require
from bridge.train.models.families.mapping import ParamMapping, routed_experts
from bridge.train.models.families.moe import (
    expert_count,
    hf_moe_layers,
    moe_layer_pattern,
    routed_moe_kwargs,
)
from bridge.train.models.families.qwen3 import Qwen3Family

__all__ = ["Qwen3MoeFamily"]


def _moe_layers(config: dict[str, Any]) -> set[int]:
    step = int(config.get("decoder_sparse_step", 1) or 1)
    dense = {int(i) for i in config.get("mlp_only_layers") or []}
    return {
        i for i in range(int(config["num_hidden_layers"])) if i not in dense and (i + 1) % step == 0
    }


@register_family
class Qwen3MoeFamily(Qwen3Family):
    """Qwen3-MoE (see the module docstring)."""

    model_types = ("qwen3_moe",)
    architecture = "Qwen3MoeForCausalLM"

    def mlp_kwargs(self, config: dict[str, Any]) -> dict[str, Any]:
        """Dense width for ``mlp_only_layers``, and the routed experts."""
        layers = int(require(config, "num_hidden_layers"))
        return {
            "ffn_hidden_size": int(require(config, "intermediate_size")),
            **routed_moe_kwargs(
                config,
                int(require(config, "moe_intermediate_size")),
                experts=expert_count(config, "num_experts", "Qwen3-MoE"),
                normalize=bool(config.get("norm_topk_prob", False)),
                pattern=moe_layer_pattern(layers, _moe_layers(config)),
            ),
        }

    def mlp_mappings(
        self, config: dict[str, Any], kwargs: dict[str, Any], layer: int, m: str, h: str
    ) -> list[ParamMapping]:
        """Router + experts on expert layers; the dense SwiGLU MLP elsewhere."""
        if layer not in _moe_layers(config):
            return super().mlp_mappings(config, kwargs, layer, m, h)
        return routed_experts(
            m, f"{h}mlp.gate.weight", f"{h}mlp.experts.", kwargs["num_moe_experts"]
        )

    def hf_extra(self, provider: Any) -> dict[str, Any]:
        """Expert fields from the provider's MoE settings."""
        moe = set(hf_moe_layers(provider))
        return {
            **super().hf_extra(provider),
            "num_experts": int(provider.num_moe_experts),
            "num_experts_per_tok": int(provider.moe_router_topk),
            "moe_intermediate_size": int(provider.moe_ffn_hidden_size),
            "norm_topk_prob": not provider.moe_router_pre_softmax,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(provider.num_layers) if i not in moe],
            "router_aux_loss_coef": float(provider.moe_aux_loss_coeff or 0.0),
        }
