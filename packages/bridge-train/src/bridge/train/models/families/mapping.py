"""Which Hugging Face tensors make each megatron parameter, and how (both directions).

A family lists one :class:`ParamMapping` per parameter of the megatron ``GPTModel`` as one
process (tensor, pipeline and expert parallel size 1) holds it; the importer, the exporter
and :class:`~bridge.train.convert.AutoBridge` shard, stream and reshard from there. The
builders here cover megatron-core's layouts:

* :func:`fused_qkv`: ``self_attention.linear_qkv`` holds query, key and value fused along
  the output dimension *per query group*: for each of the ``G`` groups, its ``H / G``
  query heads, then its key head, then its value head (``[G, (H/G + 2) * d, hidden]``).
  Tensor parallelism splits whole groups, so one layout serves every TP size.
* :func:`gated_fc1`: ``mlp.linear_fc1`` of a gated MLP is ``[gate; up]`` (megatron computes
  ``act(first half) * second half``); experts' ``linear_fc1`` too.
* :func:`vocab_rows`: the embedding and output layer have ``padded_vocab`` rows; the rows
  past the Hugging Face vocabulary are zero on import and dropped on export.
* :func:`routed_experts`: a mixture-of-experts layer: the router (``mlp.router.weight``) and
  each expert's gated MLP (``mlp.experts.local_experts.{e}.linear_fc1`` / ``linear_fc2``,
  megatron-core's ``SequentialMLP`` numbering as one process holds it; expert parallelism
  splits whole experts).
* :func:`direct`: the same tensor on both sides, optionally transposed (GPT-2's ``Conv1D``
  stores ``[in, out]``).

Every ``to_hf`` returns exactly the tensors ``to_megatron`` consumed (views split off the
megatron tensor, made contiguous), so export of an import is bit-identical.

A Hugging Face tensor may hold the weights of several megatron parameters stacked along its
first dimension (gpt-oss stores all experts of a layer as one ``[experts, ...]`` tensor):
such a mapping has ``stack=(index, count)`` and reads and writes only its ``index``-th slice
of each of its tensors. The slices of one tensor come in index order, one after the other,
in the family's list: an export writes them into the file as they arrive.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "SAME",
    "TRANSPOSED",
    "ParamMapping",
    "direct",
    "fused_qkv",
    "gated_fc1",
    "gated_mlp",
    "routed_experts",
    "self_attention",
    "vocab_rows",
]


@dataclass(frozen=True)
class ParamMapping:
    """One megatron parameter and the Hugging Face tensors it is made of.

    Attributes:
        megatron: Parameter name in the one-process megatron ``GPTModel``.
        hf: Hugging Face tensor names, in the order :attr:`to_megatron` takes them.
        to_megatron: Hugging Face tensors -> the megatron tensor.
        to_hf: The megatron tensor -> Hugging Face tensors (same order as :attr:`hf`).
        stack: ``(index, count)`` when each Hugging Face tensor stacks ``count`` such pieces
            along a new first dimension and this parameter's are the ``index``-th
            (:attr:`to_megatron` and :attr:`to_hf` see the pieces); ``None`` for whole
            tensors.
    """

    megatron: str
    hf: tuple[str, ...]
    to_megatron: Callable[..., torch.Tensor]
    to_hf: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
    stack: tuple[int, int] | None = None


# (to megatron, to Hugging Face) of one tensor kept as it is, or transposed (2-D, stored
# ``[in, out]``).
SAME = (lambda t: t, lambda t: (t,))
TRANSPOSED = (lambda t: t.t().contiguous(), lambda t: (t.t().contiguous(),))


def direct(megatron: str, hf: str, *, transpose: bool = False) -> ParamMapping:
    """The same tensor under two names (``transpose``: a 2-D tensor stored ``[in, out]``)."""
    return ParamMapping(megatron, (hf,), *(TRANSPOSED if transpose else SAME))


def vocab_rows(megatron: str, hf: str, padded_vocab: int, vocab: int) -> ParamMapping:
    """An embedding or output layer: ``vocab`` Hugging Face rows, ``padded_vocab`` megatron
    rows (the extra rows are zero)."""

    def pad(t: torch.Tensor) -> torch.Tensor:
        if t.shape[0] == padded_vocab:
            return t
        padded = t.new_zeros((padded_vocab, *t.shape[1:]))
        padded[: t.shape[0]] = t
        return padded

    return ParamMapping(megatron, (hf,), pad, lambda t: (t[:vocab].contiguous(),))


def fused_qkv(
    megatron: str, q: str, k: str, v: str, heads: int, groups: int, head_dim: int
) -> ParamMapping:
    """Separate query, key and value projections (weights or biases) <-> megatron's
    ``linear_qkv``, fused per query group (see the module docstring)."""
    per_group = heads // groups

    def fuse(q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor) -> torch.Tensor:
        rest = q_t.shape[1:]
        parts = (
            q_t.reshape(groups, per_group * head_dim, *rest),
            k_t.reshape(groups, head_dim, *rest),
            v_t.reshape(groups, head_dim, *rest),
        )
        return torch.cat(parts, dim=1).reshape(-1, *rest)

    def split(fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rest = fused.shape[1:]
        grouped = fused.reshape(groups, (per_group + 2) * head_dim, *rest)
        parts = torch.split(grouped, [per_group * head_dim, head_dim, head_dim], dim=1)
        return tuple(t.reshape(-1, *rest).contiguous() for t in parts)

    return ParamMapping(megatron, (q, k, v), fuse, split)


def gated_fc1(megatron: str, gate: str, up: str) -> ParamMapping:
    """A gated MLP's gate and up projections <-> megatron's ``linear_fc1`` = ``[gate; up]``."""

    def split(fc1: torch.Tensor) -> tuple[torch.Tensor, ...]:
        gate_t, up_t = torch.chunk(fc1, 2, dim=0)
        return gate_t.contiguous(), up_t.contiguous()

    return ParamMapping(megatron, (gate, up), lambda g, u: torch.cat([g, u], dim=0), split)


def gated_mlp(
    megatron: str,
    hf: str,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    part: str = "weight",
) -> list[ParamMapping]:
    """A gated MLP's gate, up and down projections (``{hf}{name}.{part}``) <-> megatron's
    ``{megatron}linear_fc1.{part}`` (:func:`gated_fc1`) and ``{megatron}linear_fc2.{part}``."""
    gate, up, down = names
    return [
        gated_fc1(f"{megatron}linear_fc1.{part}", f"{hf}{gate}.{part}", f"{hf}{up}.{part}"),
        direct(f"{megatron}linear_fc2.{part}", f"{hf}{down}.{part}"),
    ]


def routed_experts(
    layer: str,
    router: str,
    hf_experts: str,
    count: int,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
) -> list[ParamMapping]:
    """A mixture-of-experts MLP: the router and every expert's gated MLP.

    Args:
        layer: The megatron layer prefix (``decoder.layers.{i}.``).
        router: The Hugging Face router (gate) weight.
        hf_experts: The Hugging Face experts' prefix; expert ``e``'s weights are
            ``{hf_experts}{e}.{name}.weight``.
        count: How many experts.
        names: The Hugging Face names of an expert's gate, up and down projections.
    """
    maps = [direct(f"{layer}mlp.router.weight", router)]
    for e in range(count):
        maps += gated_mlp(f"{layer}mlp.experts.local_experts.{e}.", f"{hf_experts}{e}.", names)
    return maps


def self_attention(
    layer: str,
    hf_attention: str,
    heads: int,
    groups: int,
    head_dim: int,
    *,
    qkv_bias: bool = False,
    proj_bias: bool = False,
    qk_norm: bool = False,
) -> list[ParamMapping]:
    """A Llama-shaped attention block: ``q_proj`` / ``k_proj`` / ``v_proj`` fused into
    ``linear_qkv``, ``o_proj`` as ``linear_proj``, optional biases and QK norms
    (``q_norm`` / ``k_norm`` as ``q_layernorm`` / ``k_layernorm``).

    Args:
        layer: The megatron layer prefix (``decoder.layers.{i}.``).
        hf_attention: The Hugging Face attention prefix (``model.layers.{i}.self_attn.``).
        heads: Query heads.
        groups: Key/value heads.
        head_dim: Channels per head.
        qkv_bias: Q, K and V have biases.
        proj_bias: The output projection has a bias.
        qk_norm: Queries and keys are normed per head.
    """
    m, a = f"{layer}self_attention.", hf_attention

    def qkv(part: str) -> ParamMapping:
        q, k, v = (f"{a}{x}_proj.{part}" for x in "qkv")
        return fused_qkv(f"{m}linear_qkv.{part}", q, k, v, heads, groups, head_dim)

    maps = [qkv("weight"), direct(f"{m}linear_proj.weight", f"{a}o_proj.weight")]
    if qkv_bias:
        maps.append(qkv("bias"))
    if proj_bias:
        maps.append(direct(f"{m}linear_proj.bias", f"{a}o_proj.bias"))
    if qk_norm:
        maps += [
            direct(f"{m}q_layernorm.weight", f"{a}q_norm.weight"),
            direct(f"{m}k_layernorm.weight", f"{a}k_norm.weight"),
        ]
    return maps
