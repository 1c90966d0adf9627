"""``mixtral`` (Mixtral 8x7B, 8x22B): Mistral attention with top-k routed experts on every layer.

Experts: ``num_local_experts``, top ``num_experts_per_tok`` (2) by softmax, renormalised
(see :mod:`bridge.train.models.families.moe`), each a SwiGLU MLP of ``intermediate_size``
(``w1`` gate, ``w3`` up, ``w2`` down). ``sliding_window`` as for Mistral.
``router_aux_loss_coef`` becomes megatron's load-balancing coefficient. Refused:
``router_jitter_noise`` other than 0 (training-time noise on the router input).
"""

from __future__ import annotations

from typing import Any

from bridge.train.models.families.base import register_family
from bridge.train.models.families.config_fields import refuse, require
from bridge.train.models.families.mapping import ParamMapping, routed_experts
from bridge.train.models.families.mistral import MistralFamily
from bridge.train.models.families.moe import hf_moe_layers, routed_moe_kwargs

__all__ = ["MixtralFamily"]


@register_family
class MixtralFamily(MistralFamily):
    """Mixtral (see the module docstring)."""

    model_types = ("mixtral",)
    architecture = "MixtralForCausalLM"

    def mlp_kwargs(self, config: dict[str, Any]) -> dict[str, Any]:
        """Routed experts on every layer."""
        jitter = float(config.get("router_jitter_noise", 0.0) or 0.0)
        if jitter:
            raise refuse(
                config,
                "router_jitter_noise",
                jitter,
                "megatron-core's router has no input jitter; set it to 0.0",
            )
        ffn = int(require(config, "intermediate_size"))
        return {
            "ffn_hidden_size": ffn,
            **routed_moe_kwargs(config, ffn),
        }

    def mlp_mappings(
        self, config: dict[str, Any], kwargs: dict[str, Any], layer: int, m: str, h: str
    ) -> list[ParamMapping]:
        """The router (``block_sparse_moe.gate``) and the experts (``w1``, ``w3``, ``w2``)."""
        moe = f"{h}block_sparse_moe."
        count = int(kwargs["num_moe_experts"])
        return routed_experts(m, f"{moe}gate.weight", f"{moe}experts.", count, ("w1", "w3", "w2"))

    def hf_extra(self, provider: Any) -> dict[str, Any]:
        """Expert fields; Mixtral has experts on every layer and one FFN width."""
        if len(hf_moe_layers(provider)) != provider.num_layers or provider.moe_router_pre_softmax:
            return {"num_local_experts": None}  # not a Mixtral: the round trip refuses it
        return {
            **super().hf_extra(provider),
            "intermediate_size": int(provider.moe_ffn_hidden_size),
            "num_local_experts": int(provider.num_moe_experts),
            "num_experts_per_tok": int(provider.moe_router_topk),
            "router_aux_loss_coef": float(provider.moe_aux_loss_coeff or 0.0),
            "router_jitter_noise": 0.0,
        }
