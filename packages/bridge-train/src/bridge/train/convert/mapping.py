"""Which Hugging Face tensors make each megatron parameter, and how (both directions).

megatron-core's GPT layout (local layer spec, one tensor-parallel rank holding everything;
dist_checkpointing reshards it to any TP x PP layout at load):

* ``self_attention.linear_qkv``: query, key and value fused along the output dimension
  *per query group*: for each of the ``G`` groups, its ``H / G`` query heads, then its key
  head, then its value head (``[G, (H/G + 2) * d, hidden]``). Tensor parallelism splits
  whole groups, so this one layout serves every TP size.
* ``mlp.linear_fc1`` of a gated MLP: ``[gate; up]`` (megatron computes
  ``act(first half) * second half``).
* embedding and output layer: ``padded_vocab`` rows; the rows past the Hugging Face
  vocabulary are zero on import and dropped on export.
* GPT-2's ``Conv1D`` stores ``[in, out]``: transposed both ways.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bridge.train.convert.hf_config import LLAMA_LIKE_MODEL_TYPES

__all__ = ["ParamMapping", "hf_tensors_to_ignore", "param_mappings"]


@dataclass(frozen=True)
class ParamMapping:
    """One megatron parameter and the Hugging Face tensors it is made of.

    Attributes:
        megatron: Parameter name in the megatron ``GPTModel``.
        hf: Hugging Face tensor names, in the order :attr:`to_megatron` takes them.
        to_megatron: Hugging Face tensors -> the megatron tensor.
        to_hf: The megatron tensor -> Hugging Face tensors (same order as :attr:`hf`).
    """

    megatron: str
    hf: tuple[str, ...]
    to_megatron: Callable[..., torch.Tensor]
    to_hf: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _one(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], tuple[Any]]:
    return lambda t: (fn(t),)


def _transposed(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous()


def _pad_rows(rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def pad(t: torch.Tensor) -> torch.Tensor:
        if t.shape[0] == rows:
            return t
        padded = t.new_zeros((rows, *t.shape[1:]))
        padded[: t.shape[0]] = t
        return padded

    return pad


def _fuse_qkv(heads: int, groups: int, head_dim: int) -> Callable[..., torch.Tensor]:
    per_group = heads // groups

    def fuse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rest = q.shape[1:]
        parts = (
            q.reshape(groups, per_group * head_dim, *rest),
            k.reshape(groups, head_dim, *rest),
            v.reshape(groups, head_dim, *rest),
        )
        return torch.cat(parts, dim=1).reshape(-1, *rest)

    return fuse


def _split_qkv(
    heads: int, groups: int, head_dim: int
) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    per_group = heads // groups

    def split(fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rest = fused.shape[1:]
        grouped = fused.reshape(groups, (per_group + 2) * head_dim, *rest)
        q, k, v = torch.split(grouped, [per_group * head_dim, head_dim, head_dim], dim=1)
        return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))

    return split


def _gpt2_qkv(heads: int, head_dim: int) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """GPT-2's ``c_attn`` is ``[Q | K | V]`` along its output (last, Conv1D) dimension."""
    fuse, split = _fuse_qkv(heads, heads, head_dim), _split_qkv(heads, heads, head_dim)

    def to_megatron(c_attn: torch.Tensor) -> torch.Tensor:
        rows = c_attn.t() if c_attn.dim() == 2 else c_attn
        q, k, v = torch.chunk(rows, 3, dim=0)
        return fuse(q, k, v).contiguous()

    def to_hf(fused: torch.Tensor) -> tuple[torch.Tensor]:
        rows = torch.cat(split(fused), dim=0)
        return (rows.t().contiguous() if rows.dim() == 2 else rows,)

    return to_megatron, to_hf


def _glu() -> tuple[Callable[..., Any], Callable[..., Any]]:
    def to_megatron(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return torch.cat([gate, up], dim=0)

    def to_hf(fc1: torch.Tensor) -> tuple[torch.Tensor, ...]:
        gate, up = torch.chunk(fc1, 2, dim=0)
        return gate.contiguous(), up.contiguous()

    return to_megatron, to_hf


def _direct(megatron: str, hf: str, transform: Callable[..., Any] = _same) -> ParamMapping:
    return ParamMapping(megatron, (hf,), transform, _one(_same))


def param_mappings(config: dict[str, Any], padded_vocab: int, prefix: str) -> list[ParamMapping]:
    """Every megatron parameter of the model ``config`` describes, with its sources.

    Args:
        config: The Hugging Face ``config.json`` (a supported ``model_type``).
        padded_vocab: Rows of the megatron embedding and output layer.
        prefix: Prefix of the Hugging Face tensor names (``"model."`` for Llama-like models,
            ``"transformer."`` or ``""`` for GPT-2).

    Returns:
        The mappings; tied output layers have none (megatron shares the embedding).
    """
    vocab = int(config["vocab_size"])
    unpad = _one(lambda t: t[:vocab].contiguous())
    pad = _pad_rows(padded_vocab)
    if config["model_type"] in LLAMA_LIKE_MODEL_TYPES:
        return _llama_like(config, prefix, pad, unpad)
    return _gpt2(config, prefix, pad, unpad)


def _llama_like(
    config: dict[str, Any], prefix: str, pad: Callable[..., Any], unpad: Callable[..., Any]
) -> list[ParamMapping]:
    heads = int(config["num_attention_heads"])
    groups = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    qkv_in, qkv_out = _fuse_qkv(heads, groups, head_dim), _split_qkv(heads, groups, head_dim)
    glu_in, glu_out = _glu()
    qkv_bias = config["model_type"] == "qwen2" or bool(config.get("attention_bias"))
    linear_bias = bool(config.get("attention_bias")) and config["model_type"] == "llama"
    maps = [
        ParamMapping(
            "embedding.word_embeddings.weight", (f"{prefix}embed_tokens.weight",), pad, unpad
        )
    ]
    for i in range(int(config["num_hidden_layers"])):
        m, h = f"decoder.layers.{i}.", f"{prefix}layers.{i}."
        attn = f"{h}self_attn."
        maps += [
            _direct(f"{m}input_layernorm.weight", f"{h}input_layernorm.weight"),
            ParamMapping(
                f"{m}self_attention.linear_qkv.weight",
                tuple(f"{attn}{p}_proj.weight" for p in "qkv"),
                qkv_in,
                qkv_out,
            ),
            _direct(f"{m}self_attention.linear_proj.weight", f"{attn}o_proj.weight"),
            _direct(f"{m}pre_mlp_layernorm.weight", f"{h}post_attention_layernorm.weight"),
            ParamMapping(
                f"{m}mlp.linear_fc1.weight",
                (f"{h}mlp.gate_proj.weight", f"{h}mlp.up_proj.weight"),
                glu_in,
                glu_out,
            ),
            _direct(f"{m}mlp.linear_fc2.weight", f"{h}mlp.down_proj.weight"),
        ]
        if qkv_bias:
            maps.append(
                ParamMapping(
                    f"{m}self_attention.linear_qkv.bias",
                    tuple(f"{attn}{p}_proj.bias" for p in "qkv"),
                    qkv_in,
                    qkv_out,
                )
            )
        if linear_bias:
            maps += [
                _direct(f"{m}self_attention.linear_proj.bias", f"{attn}o_proj.bias"),
                ParamMapping(
                    f"{m}mlp.linear_fc1.bias",
                    (f"{h}mlp.gate_proj.bias", f"{h}mlp.up_proj.bias"),
                    glu_in,
                    glu_out,
                ),
                _direct(f"{m}mlp.linear_fc2.bias", f"{h}mlp.down_proj.bias"),
            ]
    maps.append(_direct("decoder.final_layernorm.weight", f"{prefix}norm.weight"))
    if not config.get("tie_word_embeddings", False):
        maps.append(ParamMapping("output_layer.weight", ("lm_head.weight",), pad, unpad))
    return maps


def _gpt2(
    config: dict[str, Any], prefix: str, pad: Callable[..., Any], unpad: Callable[..., Any]
) -> list[ParamMapping]:
    heads = int(config["n_head"])
    head_dim = int(config["n_embd"]) // heads
    qkv_in, qkv_out = _gpt2_qkv(heads, head_dim)
    conv = _one(_transposed)
    maps = [
        ParamMapping("embedding.word_embeddings.weight", (f"{prefix}wte.weight",), pad, unpad),
        _direct("embedding.position_embeddings.weight", f"{prefix}wpe.weight"),
    ]
    for i in range(int(config["n_layer"])):
        m, h = f"decoder.layers.{i}.", f"{prefix}h.{i}."
        for part in ("weight", "bias"):
            maps += [
                _direct(f"{m}input_layernorm.{part}", f"{h}ln_1.{part}"),
                _direct(f"{m}pre_mlp_layernorm.{part}", f"{h}ln_2.{part}"),
            ]
        maps += [
            ParamMapping(
                f"{m}self_attention.linear_qkv.weight", (f"{h}attn.c_attn.weight",), qkv_in, qkv_out
            ),
            ParamMapping(
                f"{m}self_attention.linear_qkv.bias", (f"{h}attn.c_attn.bias",), qkv_in, qkv_out
            ),
            ParamMapping(
                f"{m}self_attention.linear_proj.weight",
                (f"{h}attn.c_proj.weight",),
                _transposed,
                conv,
            ),
            _direct(f"{m}self_attention.linear_proj.bias", f"{h}attn.c_proj.bias"),
            ParamMapping(f"{m}mlp.linear_fc1.weight", (f"{h}mlp.c_fc.weight",), _transposed, conv),
            _direct(f"{m}mlp.linear_fc1.bias", f"{h}mlp.c_fc.bias"),
            ParamMapping(
                f"{m}mlp.linear_fc2.weight", (f"{h}mlp.c_proj.weight",), _transposed, conv
            ),
            _direct(f"{m}mlp.linear_fc2.bias", f"{h}mlp.c_proj.bias"),
        ]
    maps += [
        _direct("decoder.final_layernorm.weight", f"{prefix}ln_f.weight"),
        _direct("decoder.final_layernorm.bias", f"{prefix}ln_f.bias"),
    ]
    if not config.get("tie_word_embeddings", True):
        maps.append(ParamMapping("output_layer.weight", ("lm_head.weight",), pad, unpad))
    return maps


def hf_tensors_to_ignore(name: str) -> bool:
    """Buffers some Hugging Face checkpoints store that are not weights (recomputed)."""
    return (
        name.endswith("rotary_emb.inv_freq")
        or name.endswith(".attn.masked_bias")
        or (name.endswith(".attn.bias") and ".h." in f".{name}")
    )
