"""``gemma3_text`` (Gemma 3 1B and the text of larger ones) and the text model of ``gemma3``
(:class:`~bridge.train.models.gemma3_provider.Gemma3ModelProvider`).

What the preset sets and what it refuses, field by field, is the ``gemma3_text`` row of
docs/models.md's family table. Each layer of ``layer_types`` rotates with its own RoPE:
``rope_parameters.sliding_attention`` (``rope_local_base_freq`` before transformers 5) or
``rope_parameters.full_attention`` (``rope_theta``).

``gemma3`` (``Gemma3ForConditionalGeneration``): its ``text_config`` and language-model
tensors are imported; the vision tower and the multimodal projector are skipped (the
import reports how many tensors), and an export writes the text model (a
``gemma3_text`` / ``Gemma3ForCausalLM`` directory).
"""

from __future__ import annotations

from typing import Any

from bridge.train.models.families.base import register_family
from bridge.train.models.families.config_fields import (
    attention_layer_types,
    gelu_tanh,
    hf_layer_windows,
    layer_window_kwargs,
    refuse,
    require,
    rope_settings,
)
from bridge.train.models.families.llama import (
    LlamaFamily,
    decoder_hf_config,
    decoder_kwargs,
    hf_rope_parameters,
)
from bridge.train.models.gemma3_provider import Gemma3ModelProvider

__all__ = ["Gemma3Family"]


def _ropes(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(full attention rope, sliding attention rope)`` parameters in either spelling."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        return dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
    full = {
        "rope_theta": config.get("rope_theta", 1_000_000.0),
        **(config.get("rope_scaling") or {}),
    }
    local = {"rope_theta": config.get("rope_local_base_freq", 10_000.0)}
    return full, local


def _query_pre_attn_scalar(provider: Any) -> int | float:
    """The config's ``query_pre_attn_scalar`` for the provider's attention scale (an
    integer when it is one: transformers' config declares an int)."""
    scale = provider.softmax_scale or float(provider.kv_channels) ** -0.5
    scalar = float(scale) ** -2
    return round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar


@register_family
class Gemma3Family(LlamaFamily):
    """Gemma 3 (see the module docstring): Llama's weight layout with two more norms."""

    model_types = ("gemma3_text", "gemma3")
    architecture = "Gemma3ForCausalLM"
    provider_class = Gemma3ModelProvider
    pre_mlp_norm = "pre_feedforward_layernorm"
    after_attention = (("self_attn_bda.norm.weight", "post_attention_layernorm.weight"),)
    after_mlp = (("mlp_bda.norm.weight", "post_feedforward_layernorm.weight"),)
    hf_prefixes = ("model.", "language_model.model.", "model.language_model.", "")

    def text_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """``text_config`` of a ``gemma3`` config (the whole config for ``gemma3_text``)."""
        if config.get("model_type") != "gemma3":
            return config
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise refuse(config, "text_config", text, "a gemma3 config needs its text_config")
        merged = {"model_type": "gemma3_text", **text}
        for key in ("dtype", "torch_dtype", "tie_word_embeddings"):
            if key in config and key not in text:
                merged[key] = config[key]
        return merged

    def skips(self, name: str, config: dict[str, Any]) -> bool:
        """The vision tower and multimodal projector of ``gemma3``."""
        return name.removeprefix("model.").startswith(("vision_tower.", "multi_modal_projector."))

    def export_config(
        self, config: dict[str, Any], imported_prefix: str | None
    ) -> tuple[dict[str, Any], str]:
        """A ``gemma3`` import leaves as its text model (``Gemma3ForCausalLM``)."""
        if config.get("model_type") != "gemma3":
            return super().export_config(config, imported_prefix)
        text = self.text_config(config)
        return {**text, "architectures": [self.architecture]}, "model."

    def provider_kwargs(self, config: dict[str, Any]) -> dict[str, Any]:
        """Gemma 3's fields (see the module docstring)."""
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if config.get(key) is not None:
                raise refuse(config, key, config[key], "softcapping is not implemented")
        for key in ("use_bidirectional_attention", "attention_bias"):
            if config.get(key):
                raise refuse(config, key, True, "not implemented")
        act = config.get("hidden_activation", config.get("hidden_act", "gelu_pytorch_tanh"))
        if act not in ("gelu_pytorch_tanh", "gelu_new"):
            raise refuse(config, "hidden_activation", act, "only the tanh GELU is implemented")
        decoder = decoder_kwargs(config, tied=True)
        pattern = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6
        kinds = attention_layer_types(config, int(pattern))
        full, local = _ropes(config)
        local_settings = rope_settings(
            config,
            local.get("rope_theta", 10_000.0),
            local,
            field="rope_parameters.sliding_attention",
        )
        if set(local_settings) != {"rotary_base"}:
            raise refuse(
                config,
                "rope_parameters.sliding_attention.rope_type",
                local.get("rope_type"),
                "the sliding-window layers' RoPE is implemented without scaling",
            )
        return {
            **decoder,
            "ffn_hidden_size": int(require(config, "intermediate_size")),
            "position_embedding_type": "rope",
            "layernorm_zero_centered_gamma": True,
            "activation_func": gelu_tanh,
            "add_bias_linear": False,
            "qk_layernorm": True,
            "softmax_scale": float(config.get("query_pre_attn_scalar", decoder["kv_channels"]))
            ** -0.5,
            "rotary_base_local": local_settings["rotary_base"],
            **rope_settings(
                config,
                full.get("rope_theta", 1_000_000.0),
                full,
                field="rope_parameters.full_attention",
            ),
            **layer_window_kwargs(config, kinds),
        }

    def hf_config(self, provider: Any) -> dict[str, Any]:
        """A ``gemma3_text`` ``config.json`` for a Gemma 3 provider."""
        if type(provider).__name__ != "Gemma3ModelProvider":
            return {"model_type": "gemma3_text"}  # incomplete: the round trip refuses it
        return {
            **decoder_hf_config(self, provider),
            **hf_layer_windows(provider),
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": _query_pre_attn_scalar(provider),
            "rope_parameters": {
                "full_attention": hf_rope_parameters(provider),
                "sliding_attention": {
                    "rope_type": "default",
                    "rope_theta": float(provider.rotary_base_local),
                },
            },
            "attention_bias": False,
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
        }
