"""``llama`` (Llama 2, 3, 3.1, 3.2), and the decoder layout the Llama-like families share.

Llama: rotary position embeddings (``rope_theta``; ``rope_scaling`` of type ``llama3`` or
``linear``), RMSNorm, SwiGLU MLP (``gated_linear_unit`` with SiLU), grouped-query
attention (``num_key_value_heads``, ``head_dim``), tied or untied embeddings, no biases, or
biases on every linear layer (``attention_bias`` and ``mlp_bias`` together).

:class:`LlamaFamily` is also the base of the other Llama-shaped families (Mistral, Qwen2,
Qwen3, Qwen3-MoE, Mixtral): they override the hooks :meth:`LlamaFamily.attention_kwargs`,
:meth:`LlamaFamily.mlp_kwargs`, :meth:`LlamaFamily.attention_mappings`,
:meth:`LlamaFamily.mlp_mappings` and :meth:`LlamaFamily.hf_extra`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from bridge.train.models.families.base import HFFamily, register_family
from bridge.train.models.families.config_fields import (
    LLAMA3_FIXED,
    refuse,
    require,
    rope_settings,
    rope_theta_and_scaling,
    silu_activation,
)
from bridge.train.models.families.mapping import (
    ParamMapping,
    direct,
    gated_mlp,
    self_attention,
    vocab_rows,
)

__all__ = ["LlamaFamily", "decoder_hf_config", "decoder_kwargs", "hf_rope_parameters"]


def decoder_kwargs(
    config: dict[str, Any], *, eps: float = 1e-6, tied: bool = False
) -> dict[str, Any]:
    """The provider fields every RMSNorm, gated-MLP decoder family reads alike: sizes,
    heads, vocabulary, norm, dropout (no Q/K/V-only bias).

    Args:
        config: The language-model ``config.json``.
        eps: The family's default ``rms_norm_eps``.
        tied: The family's default ``tie_word_embeddings``.
    """
    heads = int(require(config, "num_attention_heads"))
    hidden = int(require(config, "hidden_size"))
    return {
        "num_layers": int(require(config, "num_hidden_layers")),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": int(config.get("num_key_value_heads") or heads),
        "kv_channels": int(config.get("head_dim") or hidden // heads),
        "vocab_size": int(require(config, "vocab_size")),
        "share_embeddings_and_output_weights": bool(config.get("tie_word_embeddings", tied)),
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(config.get("rms_norm_eps", eps)),
        "gated_linear_unit": True,
        "add_qkv_bias": False,
        "attention_dropout": float(config.get("attention_dropout", 0.0) or 0.0),
        "hidden_dropout": 0.0,
    }


def decoder_hf_config(family: HFFamily, provider: Any) -> dict[str, Any]:
    """The ``config.json`` fields :func:`decoder_kwargs` reads, written for ``provider``."""
    return {
        "architectures": [family.architecture],
        "model_type": family.name,
        "vocab_size": int(provider.vocab_size),
        "hidden_size": int(provider.hidden_size),
        "intermediate_size": int(provider.ffn_hidden_size),
        "num_hidden_layers": int(provider.num_layers),
        "num_attention_heads": int(provider.num_attention_heads),
        "num_key_value_heads": int(provider.num_query_groups),
        "head_dim": int(provider.kv_channels),
        "max_position_embeddings": int(provider.seq_length),
        "rms_norm_eps": float(provider.layernorm_epsilon),
        "tie_word_embeddings": bool(provider.share_embeddings_and_output_weights),
        "attention_dropout": float(provider.attention_dropout),
        "dtype": str(getattr(provider, "params_dtype", torch.float32)).removeprefix("torch."),
    }


def hf_rope_parameters(provider: Any) -> dict[str, Any]:
    """The ``rope_parameters`` of ``config.json`` (transformers >= 5) for a provider's RoPE."""
    params: dict[str, Any] = {"rope_theta": float(provider.rotary_base), "rope_type": "default"}
    if provider.rope_scaling:
        params.update(
            rope_type="llama3", factor=float(provider.rope_scaling_factor), **LLAMA3_FIXED
        )
    elif provider.seq_len_interpolation_factor is not None:
        params.update(rope_type="linear", factor=float(provider.seq_len_interpolation_factor))
    return params


@register_family
class LlamaFamily(HFFamily):
    """Llama, and the layout of every Llama-shaped decoder (see the module docstring)."""

    model_types: ClassVar[tuple[str, ...]] = ("llama",)
    architecture = "LlamaForCausalLM"
    #: The Hugging Face name of the norm before the MLP.
    pre_mlp_norm: ClassVar[str] = "post_attention_layernorm"
    #: ``(megatron, Hugging Face)`` names, after the layer prefixes, of the tensors that
    #: follow the attention's and the MLP's (the same tensor on both sides).
    after_attention: ClassVar[tuple[tuple[str, str], ...]] = ()
    after_mlp: ClassVar[tuple[tuple[str, str], ...]] = ()

    def provider_kwargs(self, config: dict[str, Any]) -> dict[str, Any]:
        """Provider fields of a Llama-shaped ``config`` (hooks add the family's own)."""
        theta, scaling = rope_theta_and_scaling(config)
        kwargs: dict[str, Any] = {
            **decoder_kwargs(config),
            "position_embedding_type": "rope",
            "activation_func": silu_activation(config),
            "add_bias_linear": False,
            **rope_settings(config, theta, scaling),
        }
        kwargs.update(self.attention_kwargs(config))
        kwargs.update(self.mlp_kwargs(config))
        return kwargs

    def attention_kwargs(self, config: dict[str, Any]) -> dict[str, Any]:
        """Attention fields: Llama's ``attention_bias`` / ``mlp_bias`` (both or neither)."""
        attention_bias = bool(config.get("attention_bias", False))
        mlp_bias = bool(config.get("mlp_bias", False))
        if attention_bias != mlp_bias:
            raise refuse(
                config,
                "attention_bias",
                attention_bias,
                f"with mlp_bias={mlp_bias}, megatron-core puts a bias on every linear layer "
                "or on none (add_bias_linear)",
            )
        return {"add_bias_linear": attention_bias}

    def mlp_kwargs(self, config: dict[str, Any]) -> dict[str, Any]:
        """MLP fields: the dense SwiGLU width."""
        return {"ffn_hidden_size": int(require(config, "intermediate_size"))}

    def param_mappings(
        self, config: dict[str, Any], padded_vocab: int, prefix: str
    ) -> list[ParamMapping]:
        """Embedding, per layer norms + :meth:`attention_mappings` + :meth:`mlp_mappings`,
        the final norm and (untied) the output layer."""
        kwargs = self.provider_kwargs(config)
        vocab = kwargs["vocab_size"]
        maps = [
            vocab_rows(
                "embedding.word_embeddings.weight",
                f"{prefix}embed_tokens.weight",
                padded_vocab,
                vocab,
            )
        ]
        for layer in range(kwargs["num_layers"]):
            m, h = f"decoder.layers.{layer}.", f"{prefix}layers.{layer}."
            maps.append(direct(f"{m}input_layernorm.weight", f"{h}input_layernorm.weight"))
            maps += self.attention_mappings(config, kwargs, m, h)
            maps += [direct(f"{m}{mine}", f"{h}{theirs}") for mine, theirs in self.after_attention]
            maps.append(direct(f"{m}pre_mlp_layernorm.weight", f"{h}{self.pre_mlp_norm}.weight"))
            maps += self.mlp_mappings(config, kwargs, layer, m, h)
            maps += [direct(f"{m}{mine}", f"{h}{theirs}") for mine, theirs in self.after_mlp]
        maps.append(direct("decoder.final_layernorm.weight", f"{prefix}norm.weight"))
        if not kwargs["share_embeddings_and_output_weights"]:
            # A multimodal checkpoint's language model keeps its head under its own prefix.
            head = "language_model." if prefix.startswith("language_model.") else ""
            maps.append(
                vocab_rows("output_layer.weight", f"{head}lm_head.weight", padded_vocab, vocab)
            )
        return maps

    def attention_mappings(
        self, config: dict[str, Any], kwargs: dict[str, Any], m: str, h: str
    ) -> list[ParamMapping]:
        """Fused QKV (weight and bias), the output projection, and QK norms where the
        provider fields (``kwargs``) have them; ``m`` / ``h``: the layer's megatron and
        Hugging Face name prefixes."""
        return self_attention(
            m,
            f"{h}self_attn.",
            kwargs["num_attention_heads"],
            kwargs["num_query_groups"],
            kwargs["kv_channels"],
            qkv_bias=bool(kwargs.get("add_qkv_bias") or kwargs.get("add_bias_linear")),
            proj_bias=bool(kwargs.get("add_bias_linear")),
            qk_norm=bool(kwargs.get("qk_layernorm")),
        )

    def mlp_mappings(
        self, config: dict[str, Any], kwargs: dict[str, Any], layer: int, m: str, h: str
    ) -> list[ParamMapping]:
        """The dense SwiGLU MLP (weights, and biases with ``mlp_bias``)."""
        maps = gated_mlp(f"{m}mlp.", f"{h}mlp.")
        if kwargs.get("add_bias_linear"):
            maps += gated_mlp(f"{m}mlp.", f"{h}mlp.", part="bias")
        return maps

    def hf_config(self, provider: Any) -> dict[str, Any]:
        """A Llama-shaped ``config.json`` for ``provider`` (:meth:`hf_extra` adds the
        family's own fields)."""
        return {
            **decoder_hf_config(self, provider),
            "hidden_act": "silu",
            "rope_parameters": hf_rope_parameters(provider),
            **self.hf_extra(provider),
        }

    def hf_extra(self, provider: Any) -> dict[str, Any]:
        """The family's own ``config.json`` fields for ``provider``."""
        return {
            "attention_bias": bool(provider.add_bias_linear),
            "mlp_bias": bool(provider.add_bias_linear),
        }
