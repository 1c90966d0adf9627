"""``gpt_oss`` (gpt-oss-20b, gpt-oss-120b): grouped-query attention with sinks and
alternating sliding windows, and biased experts with a clamped SwiGLU
(:class:`~bridge.train.models.gpt_oss_provider.GptOssModelProvider`).

What the preset sets and what it refuses, field by field, is the ``gpt_oss`` row of
docs/models.md's family table; each refusal names its field and why megatron-core computes
it differently (:meth:`GptOssFamily.provider_kwargs`). ``hidden_act`` is not read:
transformers' gpt-oss experts compute their own activation.

The experts' weights are stored stacked (``mlp.experts.gate_up_proj`` ``[experts, hidden,
2 * intermediate]`` with the gate and up columns interleaved, ``down_proj`` ``[experts,
intermediate, hidden]``, and their biases): each megatron expert reads its slice, and an
export writes the slices back into the stacked tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.fusions.fused_bias_geglu import quick_gelu

from bridge.train.models.families.base import register_family
from bridge.train.models.families.config_fields import (
    attention_layer_types,
    hf_layer_windows,
    layer_window_kwargs,
    refuse,
    require,
    rope_or_yarn,
    rope_theta_and_scaling,
)
from bridge.train.models.families.llama import (
    LlamaFamily,
    decoder_hf_config,
    decoder_kwargs,
    hf_rope_parameters,
)
from bridge.train.models.families.mapping import SAME, TRANSPOSED, ParamMapping, direct
from bridge.train.models.families.moe import routed_moe_kwargs
from bridge.train.models.gpt_oss_provider import GptOssModelProvider

__all__ = ["GptOssFamily"]

_QUICK_GELU_ALPHA = 1.702
_DEFAULT_THETA = 150000.0  # transformers' GptOssConfig.default_theta
# config.json's YaRN keys -> megatron's GPT YaRN fields (read and written alike).
_YARN_FIELDS = {
    "factor": "yarn_rotary_scaling_factor",
    "original_max_position_embeddings": "yarn_original_max_position_embeddings",
    "beta_fast": "yarn_beta_fast",
    "beta_slow": "yarn_beta_slow",
    "truncate": "yarn_correction_range_round_to_int",
    "mscale": "yarn_mscale",
    "mscale_all_dim": "yarn_mscale_all_dim",
}


def _rope_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """``rotary_base`` and, for YaRN, megatron's ``yarn_*`` fields."""
    theta, scaling = rope_theta_and_scaling({"rope_theta": _DEFAULT_THETA, **config})
    settings, yarn = rope_or_yarn(
        config, theta, scaling, "gpt-oss is implemented with the 'default' and 'yarn' RoPE"
    )
    if yarn is None:
        return {**settings, "position_embedding_type": "rope"}
    if not (yarn["mscale"] and yarn["mscale_all_dim"]):
        # megatron uses the mscale pair only when both are set and non-zero (as transformers).
        yarn.update(mscale=None, mscale_all_dim=None)
    return {
        **settings,
        "position_embedding_type": "yarn",
        **{field: yarn[key] for key, field in _YARN_FIELDS.items()},
    }


def _gate_up(t: torch.Tensor) -> torch.Tensor:
    """Gate and up interleaved along the last dimension -> ``[gate | up]``."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def _interleaved(t: torch.Tensor) -> torch.Tensor:
    """``[gate | up]`` along the last dimension -> gate and up interleaved."""
    gate, up = torch.chunk(t, 2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


def _stacked_experts(layer: str, hf_experts: str, experts: int) -> list[ParamMapping]:
    """Each expert's slice of the four stacked tensors, tensor by tensor in expert order
    (``gate_up_proj`` is ``[hidden, 2I]``, megatron's ``linear_fc1`` ``[gate; up]``)."""
    kinds = (
        (
            "linear_fc1.weight",
            "gate_up_proj",
            lambda t: _gate_up(t).t().contiguous(),
            lambda t: (_interleaved(t.t()).contiguous(),),
        ),
        ("linear_fc1.bias", "gate_up_proj_bias", _gate_up, lambda t: (_interleaved(t),)),
        ("linear_fc2.weight", "down_proj", *TRANSPOSED),
        ("linear_fc2.bias", "down_proj_bias", *SAME),
    )
    return [
        ParamMapping(
            f"{layer}mlp.experts.local_experts.{e}.{megatron}",
            (f"{hf_experts}{hf}",),
            to_megatron,
            to_hf,
            stack=(e, experts),
        )
        for megatron, hf, to_megatron, to_hf in kinds
        for e in range(experts)
    ]


@register_family
class GptOssFamily(LlamaFamily):
    """gpt-oss (see the module docstring)."""

    model_types = ("gpt_oss",)
    architecture = "GptOssForCausalLM"
    provider_class = GptOssModelProvider
    after_attention = (("self_attention.core_attention.softmax_offset", "self_attn.sinks"),)

    def provider_kwargs(self, config: dict[str, Any]) -> dict[str, Any]:
        """gpt-oss's fields (see the module docstring)."""
        if config.get("quantization_config") is not None:
            method = (config["quantization_config"] or {}).get("quant_method", "?")
            raise refuse(
                config,
                "quantization_config.quant_method",
                method,
                "quantized expert weights are not imported; dequantize the checkpoint first "
                "(transformers: Mxfp4Config(dequantize=True), then save_pretrained)",
            )
        if not config.get("attention_bias", True):
            raise refuse(
                config,
                "attention_bias",
                False,
                "megatron-core biases every linear layer or none (add_bias_linear) and "
                "gpt-oss experts and router always have biases",
            )
        alpha = float(config.get("swiglu_alpha", _QUICK_GELU_ALPHA))
        if alpha != _QUICK_GELU_ALPHA:
            raise refuse(
                config,
                "swiglu_alpha",
                alpha,
                f"megatron-core's quick_gelu fixes the sigmoid gain at {_QUICK_GELU_ALPHA}",
            )

        limit = config.get("swiglu_limit", 7.0)
        ffn = int(require(config, "intermediate_size"))
        return {
            **decoder_kwargs(config, eps=1e-5),
            "activation_func": quick_gelu,
            "activation_func_clamp_value": None if limit is None else float(limit),
            "glu_linear_offset": 1.0,
            "add_bias_linear": True,
            "softmax_type": "learnable",
            "ffn_hidden_size": ffn,
            **_rope_kwargs(config),
            **routed_moe_kwargs(config, ffn),
            **layer_window_kwargs(config, attention_layer_types(config, 2)),
        }

    def mlp_mappings(
        self, config: dict[str, Any], kwargs: dict[str, Any], layer: int, m: str, h: str
    ) -> list[ParamMapping]:
        """The router (weight and bias) and every expert's slice of the stacked tensors."""
        return [
            direct(f"{m}mlp.router.weight", f"{h}mlp.router.weight"),
            direct(f"{m}mlp.router.bias", f"{h}mlp.router.bias"),
            *_stacked_experts(m, f"{h}mlp.experts.", kwargs["num_moe_experts"]),
        ]

    def hf_config(self, provider: Any) -> dict[str, Any]:
        """A ``gpt_oss`` ``config.json`` for a gpt-oss provider (an incomplete one, which
        the round trip refuses, for any other)."""
        if type(provider).__name__ != "GptOssModelProvider" or not provider.num_moe_experts:
            return {"model_type": self.name}
        if provider.position_embedding_type == "yarn":
            rope: dict[str, Any] = {"rope_type": "yarn", "rope_theta": float(provider.rotary_base)}
            rope.update((key, getattr(provider, field)) for key, field in _YARN_FIELDS.items())
            if rope["mscale"] is None or rope["mscale_all_dim"] is None:
                del rope["mscale"], rope["mscale_all_dim"]
        else:
            rope = hf_rope_parameters(provider)
        return {
            **decoder_hf_config(self, provider),
            **hf_layer_windows(provider),
            "intermediate_size": int(provider.moe_ffn_hidden_size),
            "num_local_experts": int(provider.num_moe_experts),
            "num_experts_per_tok": int(provider.moe_router_topk),
            "rope_parameters": rope,
            "swiglu_alpha": _QUICK_GELU_ALPHA,
            "swiglu_limit": provider.activation_func_clamp_value,
            "router_aux_loss_coef": float(provider.moe_aux_loss_coeff or 0.0),
            "attention_bias": True,
        }
