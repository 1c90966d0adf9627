"""``gpt2``: learned absolute positions, LayerNorm with bias, GELU, biases everywhere.

Learned positions (``n_positions`` rows, so the training sequence is at most that long),
LayerNorm with bias (``layer_norm_epsilon``), a GELU MLP (the tanh approximation for
``gelu_new`` / ``gelu_pytorch_tanh`` / ``gelu_fast``; also exact ``gelu`` and ``relu``),
biases on every linear layer, tied embeddings. GPT-2's ``Conv1D`` stores weights as
``[in, out]``: they are transposed both ways, and ``c_attn`` is ``[Q | K | V]`` along its
output dimension. Refused: ``scale_attn_by_inverse_layer_idx``, ``add_cross_attention``,
``reorder_and_upcast_attn``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from bridge.train.models.families.base import HFFamily, register_family
from bridge.train.models.families.config_fields import gelu_tanh, refuse, require
from bridge.train.models.families.mapping import ParamMapping, direct, fused_qkv, vocab_rows

__all__ = ["GPT2Family"]

_ACTIVATIONS: dict[str, Callable[..., Any]] = {
    "gelu_new": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_fast": gelu_tanh,
    "gelu": torch.nn.functional.gelu,
    "relu": torch.nn.functional.relu,
}


# megatron's linear layers of a block and GPT-2's Conv1D modules, in writing order.
_LINEARS = (
    ("self_attention.linear_qkv", "attn.c_attn"),
    ("self_attention.linear_proj", "attn.c_proj"),
    ("mlp.linear_fc1", "mlp.c_fc"),
    ("mlp.linear_fc2", "mlp.c_proj"),
)


def _c_attn(megatron: str, hf: str, heads: int, head_dim: int) -> ParamMapping:
    """GPT-2's ``c_attn`` (``[Q | K | V]`` along the Conv1D output, the last dimension)."""
    fused = fused_qkv(megatron, "q", "k", "v", heads, heads, head_dim)

    def to_megatron(c_attn: torch.Tensor) -> torch.Tensor:
        rows = c_attn.t() if c_attn.dim() == 2 else c_attn
        return fused.to_megatron(*torch.chunk(rows, 3, dim=0)).contiguous()

    def to_hf(qkv: torch.Tensor) -> tuple[torch.Tensor]:
        rows = torch.cat(fused.to_hf(qkv), dim=0)
        return (rows.t().contiguous() if rows.dim() == 2 else rows,)

    return ParamMapping(megatron, (hf,), to_megatron, to_hf)


@register_family
class GPT2Family(HFFamily):
    """GPT-2 (see the module docstring)."""

    model_types = ("gpt2",)
    architecture = "GPT2LMHeadModel"
    hf_prefixes = ("transformer.", "")
    embedding = "wte.weight"
    positions_field = "n_positions"

    def ignores(self, name: str) -> bool:
        """GPT-2 checkpoints may store the causal-mask buffers (recomputed)."""
        return name.endswith(".attn.masked_bias") or (
            name.endswith(".attn.bias") and ".h." in f".{name}"
        )

    def provider_kwargs(self, config: dict[str, Any]) -> dict[str, Any]:
        """GPT-2's fields (see the module docstring)."""
        for key in (
            "add_cross_attention",
            "scale_attn_by_inverse_layer_idx",
            "reorder_and_upcast_attn",
        ):
            if config.get(key):
                raise refuse(config, key, True, "not implemented")
        act = config.get("activation_function", "gelu_new")
        if act not in _ACTIVATIONS:
            raise refuse(
                config, "activation_function", act, f"use one of {', '.join(_ACTIVATIONS)}"
            )
        hidden = int(require(config, "n_embd"))
        return {
            "num_layers": int(require(config, "n_layer")),
            "hidden_size": hidden,
            "ffn_hidden_size": int(config.get("n_inner") or 4 * hidden),
            "num_attention_heads": int(require(config, "n_head")),
            "vocab_size": int(require(config, "vocab_size")),
            "seq_length": int(require(config, "n_positions")),
            "share_embeddings_and_output_weights": bool(config.get("tie_word_embeddings", True)),
            "position_embedding_type": "learned_absolute",
            "normalization": "LayerNorm",
            "layernorm_epsilon": float(config.get("layer_norm_epsilon", 1e-5)),
            "gated_linear_unit": False,
            "activation_func": _ACTIVATIONS[act],
            "add_bias_linear": True,
            "add_qkv_bias": True,
            "hidden_dropout": float(config.get("resid_pdrop", 0.1)),
            "attention_dropout": float(config.get("attn_pdrop", 0.1)),
        }

    def param_mappings(
        self, config: dict[str, Any], padded_vocab: int, prefix: str
    ) -> list[ParamMapping]:
        """GPT-2's tensors (Conv1D weights transposed)."""
        heads = int(config["n_head"])
        head_dim = int(config["n_embd"]) // heads
        vocab = int(config["vocab_size"])
        maps = [
            vocab_rows(
                "embedding.word_embeddings.weight", f"{prefix}wte.weight", padded_vocab, vocab
            ),
            direct("embedding.position_embeddings.weight", f"{prefix}wpe.weight"),
        ]
        for i in range(int(config["n_layer"])):
            m, h = f"decoder.layers.{i}.", f"{prefix}h.{i}."
            for part in ("weight", "bias"):
                maps += [
                    direct(f"{m}input_layernorm.{part}", f"{h}ln_1.{part}"),
                    direct(f"{m}pre_mlp_layernorm.{part}", f"{h}ln_2.{part}"),
                ]
            for megatron, hf in _LINEARS:  # Conv1D weights transposed, biases as they are
                for part in ("weight", "bias"):
                    mp, hp = f"{m}{megatron}.{part}", f"{h}{hf}.{part}"
                    if hf == "attn.c_attn":
                        maps.append(_c_attn(mp, hp, heads, head_dim))
                    else:
                        maps.append(direct(mp, hp, transpose=part == "weight"))
        maps += [
            direct("decoder.final_layernorm.weight", f"{prefix}ln_f.weight"),
            direct("decoder.final_layernorm.bias", f"{prefix}ln_f.bias"),
        ]
        if not config.get("tie_word_embeddings", True):
            maps.append(vocab_rows("output_layer.weight", "lm_head.weight", padded_vocab, vocab))
        return maps

    def hf_config(self, provider: Any) -> dict[str, Any]:
        """A GPT-2 ``config.json`` for ``provider``."""
        names = {id(fn): name for name, fn in reversed(list(_ACTIVATIONS.items()))}
        return {
            "architectures": [self.architecture],
            "model_type": "gpt2",
            "vocab_size": int(provider.vocab_size),
            "n_embd": int(provider.hidden_size),
            "n_inner": int(provider.ffn_hidden_size),
            "n_layer": int(provider.num_layers),
            "n_head": int(provider.num_attention_heads),
            "n_positions": int(provider.seq_length),
            "layer_norm_epsilon": float(provider.layernorm_epsilon),
            "activation_function": names.get(id(provider.activation_func), "unknown"),
            "tie_word_embeddings": bool(provider.share_embeddings_and_output_weights),
            "resid_pdrop": float(provider.hidden_dropout),
            "embd_pdrop": float(provider.hidden_dropout),
            "attn_pdrop": float(provider.attention_dropout),
            "dtype": str(provider.params_dtype).removeprefix("torch."),
        }
