"""``deepseek_v3`` (DeepSeek-V3, V3.1, R1 and their small relatives): multi-latent
attention (:class:`~bridge.train.models.mla_provider.MLAModelProvider`) and sigmoid-routed
experts with shared experts.

What the preset sets and what it refuses, field by field, is the ``deepseek_v3`` row of
docs/models.md's family table; each refusal names its field and why megatron-core computes
it differently (:meth:`DeepseekV3Family.provider_kwargs`). The load-balancing loss is for
training only (transformers has none): the config's ``aux_loss_alpha``, else DeepSeek-V3's
sequence-wise loss.

Multi-token-prediction layers (``num_nextn_predict_layers``; DeepSeek-V3's layer 61) are not
imported: transformers' ``DeepseekV3ForCausalLM`` does not run them (its logits come from the
decoder alone), so their tensors are skipped (the import says how many) and an export writes
none, with ``num_nextn_predict_layers: 0``.
"""

from __future__ import annotations

import re
from typing import Any

from bridge.train.models.families.base import register_family
from bridge.train.models.families.config_fields import (
    refuse,
    require,
    rope_or_yarn,
    rope_theta_and_scaling,
    silu_activation,
)
from bridge.train.models.families.llama import LlamaFamily, decoder_hf_config, decoder_kwargs
from bridge.train.models.families.mapping import ParamMapping, direct, gated_mlp, routed_experts
from bridge.train.models.families.moe import expert_count, hf_moe_layers, moe_layer_pattern
from bridge.train.models.mla_provider import MLAModelProvider

__all__ = ["DeepseekV3Family"]

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")
_DEFAULT_SEQ_AUX = 1e-4  # DeepSeek-V3's sequence-wise balance loss coefficient (its paper)
_LATENT_NORM_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm
# config.json's YaRN keys -> MLATransformerConfig's fields (read and written alike).
_YARN_FIELDS = {
    "factor": "rotary_scaling_factor",
    "original_max_position_embeddings": "original_max_position_embeddings",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "mscale": "mscale",
    "mscale_all_dim": "mscale_all_dim",
}


def _first_dense(config: dict[str, Any]) -> int:
    return int(config.get("first_k_dense_replace") or 0)


def _rope_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """MLA's RoPE fields: plain RoPE, or YaRN as megatron's MLA computes it."""
    settings, yarn = rope_or_yarn(
        config,
        *rope_theta_and_scaling(config),
        "megatron-core's multi-latent attention implements the 'default' and 'yarn' RoPE",
    )
    plain = {
        **settings,  # an integer base and fully rotated heads, for either RoPE
        "rope_type": "rope",
        # mscale(1, 0) = 1: no change to the softmax scale.
        "rotary_scaling_factor": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.0,
    }
    if yarn is None:
        return plain
    if not yarn["truncate"]:
        raise refuse(
            config,
            "rope_parameters.truncate",
            False,
            "megatron-core's multi-latent YaRN rounds the correction range to whole dimensions",
        )
    # transformers scales cos/sin by mscale(f, mscale)/mscale(f, mscale_all_dim) when both
    # are set, else by mscale(f); the softmax by mscale(f, mscale_all_dim)**2 when it is set.
    # megatron's MLA always uses the ratio and mscale(f, mscale_all_dim)**2.
    if not yarn["mscale_all_dim"]:
        yarn.update(mscale=1.0, mscale_all_dim=0.0)
    elif not yarn["mscale"]:
        raise refuse(
            config,
            "rope_parameters.mscale",
            yarn["mscale"],
            f"with mscale_all_dim={yarn['mscale_all_dim']}, transformers scales cos and sin by "
            "mscale(factor) alone, which megatron-core's multi-latent YaRN does not compute",
        )
    return {**plain, "rope_type": "yarn", **{f: yarn[key] for key, f in _YARN_FIELDS.items()}}


def _router_kwargs(config: dict[str, Any], experts: int, topk: int) -> dict[str, Any]:
    """Sigmoid routing with the bias correction, group limits, renormalisation, scaling."""
    for key, wanted in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        value = config.get(key)
        if value is not None and value != wanted:
            raise refuse(config, key, value, f"transformers' DeepSeek-V3 computes only {wanted!r}")
    normalize = config.get("norm_topk_prob", True)
    if bool(normalize) != (topk > 1):
        raise refuse(
            config,
            "norm_topk_prob",
            normalize,
            f"with num_experts_per_tok={topk}, megatron-core "
            f"{'always renormalises' if topk > 1 else 'does not renormalise'} the chosen "
            "sigmoid scores",
        )
    groups = int(config.get("n_group") or 1)
    chosen = int(config.get("topk_group") or 1)
    if experts % groups:
        raise refuse(config, "n_group", groups, f"it must divide the {experts} routed experts")
    if not 1 <= chosen <= groups:
        raise refuse(config, "topk_group", chosen, f"it must be between 1 and n_group={groups}")
    kwargs: dict[str, Any] = {
        "moe_router_score_function": "sigmoid",
        "moe_router_pre_softmax": False,
        "moe_router_enable_expert_bias": True,
        "moe_router_dtype": "fp32",
        "moe_router_topk_scaling_factor": float(config.get("routed_scaling_factor") or 1.0),
        "moe_router_num_groups": None,
        "moe_router_group_topk": None,
    }
    if chosen < groups:  # with every group chosen, the limit changes nothing
        if topk % chosen or topk // chosen != 2:
            raise refuse(
                config,
                "topk_group",
                chosen,
                f"transformers ranks the groups by their two best scores, megatron-core by "
                f"the best num_experts_per_tok / topk_group = {topk / chosen:g}",
            )
        kwargs.update(moe_router_num_groups=groups, moe_router_group_topk=chosen)
    return kwargs


def _balance_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """Training's load-balancing loss (see the module docstring)."""
    alpha = config.get("aux_loss_alpha")
    sequence_wise = alpha is None or config.get("seq_aux", True)
    return {
        "moe_router_load_balancing_type": "seq_aux_loss" if sequence_wise else "aux_loss",
        "moe_aux_loss_coeff": _DEFAULT_SEQ_AUX if alpha is None else float(alpha),
    }


@register_family
class DeepseekV3Family(LlamaFamily):
    """DeepSeek-V3 (see the module docstring)."""

    model_types = ("deepseek_v3",)
    architecture = "DeepseekV3ForCausalLM"
    provider_class = MLAModelProvider

    def skips(self, name: str, config: dict[str, Any]) -> bool:
        """Multi-token-prediction layers (numbered from ``num_hidden_layers`` on)."""
        match = _LAYER.match(name)
        return match is not None and int(match.group(1)) >= int(config["num_hidden_layers"])

    def export_config(
        self, config: dict[str, Any], imported_prefix: str | None
    ) -> tuple[dict[str, Any], str]:
        """The source's config, saying that no multi-token-prediction layers are written."""
        written, prefix = super().export_config(config, imported_prefix)
        if written.get("num_nextn_predict_layers"):
            written = {**written, "num_nextn_predict_layers": 0}
        return written, prefix

    def provider_kwargs(self, config: dict[str, Any]) -> dict[str, Any]:
        """DeepSeek-V3's fields (see the module docstring)."""
        heads = int(require(config, "num_attention_heads"))
        kv_heads = config.get("num_key_value_heads")
        if kv_heads is not None and int(kv_heads) != heads:
            raise refuse(
                config,
                "num_key_value_heads",
                kv_heads,
                f"multi-latent attention expands keys and values to all {heads} heads "
                "(transformers' DeepSeek-V3 works only with num_key_value_heads equal to "
                "num_attention_heads)",
            )
        if config.get("q_lora_rank") is None:
            raise refuse(
                config,
                "q_lora_rank",
                None,
                "megatron-core 0.19's local multi-latent attention needs the low-rank query "
                "projection",
            )
        if not config.get("rope_interleave", True):
            raise refuse(
                config,
                "rope_interleave",
                False,
                "megatron-core's multi-latent attention rotates interleaved pairs",
            )
        if config.get("attention_bias"):
            raise refuse(
                config,
                "attention_bias",
                True,
                "megatron-core's multi-latent attention projections have no biases",
            )
        eps = float(config.get("rms_norm_eps", _LATENT_NORM_EPS))
        if eps != _LATENT_NORM_EPS:
            raise refuse(
                config,
                "rms_norm_eps",
                eps,
                f"transformers' latent norms use {_LATENT_NORM_EPS} whatever rms_norm_eps "
                "says, megatron-core one epsilon for every norm",
            )
        layers = int(require(config, "num_hidden_layers"))
        experts = expert_count(config, "n_routed_experts", "DeepSeek-V3")
        topk = int(require(config, "num_experts_per_tok"))
        expert_ffn = int(require(config, "moe_intermediate_size"))
        shared = config.get("n_shared_experts")
        if shared is None or int(shared) < 1:
            raise refuse(
                config, "n_shared_experts", shared, "DeepSeek-V3 layers have shared experts"
            )
        freq = config.get("moe_layer_freq")
        if freq is not None and int(freq) != 1:
            raise refuse(
                config,
                "moe_layer_freq",
                freq,
                "transformers' DeepSeek-V3 puts experts on "
                "every layer from first_k_dense_replace on",
            )
        first_dense = _first_dense(config)
        v_head_dim = int(require(config, "v_head_dim"))
        return {
            **decoder_kwargs(config),
            "num_query_groups": heads,
            "kv_channels": v_head_dim,
            "position_embedding_type": "rope",
            "activation_func": silu_activation(config),
            "add_bias_linear": False,
            "multi_latent_attention": True,
            "qk_layernorm": True,
            "q_lora_rank": int(config["q_lora_rank"]),
            "kv_lora_rank": int(require(config, "kv_lora_rank")),
            "qk_head_dim": int(require(config, "qk_nope_head_dim")),
            "qk_pos_emb_head_dim": int(require(config, "qk_rope_head_dim")),
            "v_head_dim": v_head_dim,
            **_rope_kwargs(config),
            "ffn_hidden_size": int(require(config, "intermediate_size")),
            "num_moe_experts": experts,
            "moe_router_topk": topk,
            "moe_ffn_hidden_size": expert_ffn,
            "moe_shared_expert_intermediate_size": int(shared) * expert_ffn,
            "moe_layer_freq": moe_layer_pattern(layers, set(range(first_dense, layers))),
            "moe_grouped_gemm": False,
            **_router_kwargs(config, experts, topk),
            **_balance_kwargs(config),
        }

    def attention_mappings(
        self, config: dict[str, Any], kwargs: dict[str, Any], m: str, h: str
    ) -> list[ParamMapping]:
        """The latent projections and their norms, and the output projection."""
        a, s = f"{h}self_attn.", f"{m}self_attention."
        return [
            direct(f"{s}linear_q_down_proj.weight", f"{a}q_a_proj.weight"),
            direct(f"{s}q_layernorm.weight", f"{a}q_a_layernorm.weight"),
            direct(f"{s}linear_q_up_proj.weight", f"{a}q_b_proj.weight"),
            direct(f"{s}linear_kv_down_proj.weight", f"{a}kv_a_proj_with_mqa.weight"),
            direct(f"{s}kv_layernorm.weight", f"{a}kv_a_layernorm.weight"),
            direct(f"{s}linear_kv_up_proj.weight", f"{a}kv_b_proj.weight"),
            direct(f"{s}linear_proj.weight", f"{a}o_proj.weight"),
        ]

    def mlp_mappings(
        self, config: dict[str, Any], kwargs: dict[str, Any], layer: int, m: str, h: str
    ) -> list[ParamMapping]:
        """The dense MLP on the first layers; router (weight and bias correction), routed
        and shared experts on the others."""
        if layer < _first_dense(config):
            return super().mlp_mappings(config, kwargs, layer, m, h)
        return [
            *routed_experts(
                m, f"{h}mlp.gate.weight", f"{h}mlp.experts.", kwargs["num_moe_experts"]
            ),
            direct(f"{m}mlp.router.expert_bias", f"{h}mlp.gate.e_score_correction_bias"),
            *gated_mlp(f"{m}mlp.shared_experts.", f"{h}mlp.shared_experts."),
        ]

    def hf_config(self, provider: Any) -> dict[str, Any]:
        """A ``deepseek_v3`` ``config.json`` for a multi-latent MoE provider (an incomplete
        one, which the round trip refuses, for any other)."""
        if not getattr(provider, "multi_latent_attention", False) or not getattr(
            provider, "num_moe_experts", None
        ):
            return {"model_type": self.name}
        moe = set(hf_moe_layers(provider))
        first_dense = min(moe) if moe else provider.num_layers
        shared = provider.moe_shared_expert_intermediate_size or 0
        if moe != set(range(first_dense, provider.num_layers)) or shared % int(
            provider.moe_ffn_hidden_size
        ):
            return {"model_type": self.name}  # not a DeepSeek-V3 layout
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(provider.rotary_base)}
        if provider.rope_type == "yarn":
            rope["rope_type"] = "yarn"
            rope.update((key, getattr(provider, field)) for key, field in _YARN_FIELDS.items())
        groups = provider.moe_router_num_groups
        config = decoder_hf_config(self, provider)
        del config["head_dim"]  # transformers derives it from the latent head sizes
        return {
            **config,
            "moe_intermediate_size": int(provider.moe_ffn_hidden_size),
            "num_key_value_heads": int(provider.num_attention_heads),
            "n_shared_experts": shared // int(provider.moe_ffn_hidden_size),
            "n_routed_experts": int(provider.num_moe_experts),
            "routed_scaling_factor": float(provider.moe_router_topk_scaling_factor or 1.0),
            "kv_lora_rank": int(provider.kv_lora_rank),
            "q_lora_rank": provider.q_lora_rank,
            "qk_rope_head_dim": int(provider.qk_pos_emb_head_dim),
            "qk_nope_head_dim": int(provider.qk_head_dim),
            "v_head_dim": int(provider.v_head_dim),
            "n_group": int(groups or 1),
            "topk_group": int(provider.moe_router_group_topk or groups or 1),
            "num_experts_per_tok": int(provider.moe_router_topk),
            "first_k_dense_replace": first_dense,
            "norm_topk_prob": int(provider.moe_router_topk) > 1,
            "hidden_act": "silu",
            "rope_parameters": rope,
            "rope_interleave": True,
            "attention_bias": False,
            "num_nextn_predict_layers": 0,
            "aux_loss_alpha": float(provider.moe_aux_loss_coeff or 0.0),
            "seq_aux": provider.moe_router_load_balancing_type == "seq_aux_loss",
        }
