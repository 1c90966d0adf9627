"""Choose and build the transformer layer spec a GPT model runs with.

Four implementations are selectable (``GPTModelProvider.layer_spec_backend``):

``"portable"``
    megatron-core's local spec (megatron's own linear layers and norms) with core attention
    replaced by torch ``scaled_dot_product_attention``
    (:class:`core_utils.portable_attention.SDPACoreAttention`). Runs on every device,
    including CPU, with tensor parallelism over gloo; multi-latent attention (megatron's
    ``MLASelfAttention`` around the same core attention) and attention sinks
    (``softmax_type``) included. No context parallelism. With ``sequence_parallel`` its
    norms are :class:`SequenceParallelTorchNorm` (megatron's torch norms refuse sequence
    parallelism), which megatron-core's MoE layers need with tensor parallelism.
``"local"``
    megatron-core's local spec unchanged. Its ``DotProductAttention`` takes a buffer from
    ``torch.cuda.current_device()``: CUDA only.
``"transformer_engine"``
    Transformer Engine modules (fused kernels, fp8, context parallelism). CUDA and the ``te``
    extra (``pip install bridge-train[te]``) required.
``"auto"`` (default)
    ``"transformer_engine"`` on CUDA when Transformer Engine is installed, ``"local"`` on
    CUDA without it, ``"portable"`` without CUDA.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
from typing import TYPE_CHECKING, Any, Literal

import torch
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from bridge.train.models.expert_linear import ExpertRowParallelLinear
from core_utils.portable_attention import with_sdpa_core_attention

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

    from bridge.train.models.gpt_provider import GPTModelProvider

__all__ = [
    "LayerSpecBackend",
    "SequenceParallelTorchNorm",
    "build_gpt_layer_spec",
    "resolve_layer_spec_backend",
]

LayerSpecBackend = Literal["auto", "portable", "local", "transformer_engine"]
_BACKENDS = ("auto", "portable", "local", "transformer_engine")


def _transformer_engine_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def resolve_layer_spec_backend(
    requested: str, *, cuda_available: bool | None = None, te_installed: bool | None = None
) -> Literal["portable", "local", "transformer_engine"]:
    """Resolve ``requested`` (possibly ``"auto"``) to the implementation that will be built.

    Args:
        requested: One of ``"auto"``, ``"portable"``, ``"local"``, ``"transformer_engine"``.
        cuda_available: Override CUDA detection (defaults to ``torch.cuda.is_available()``).
        te_installed: Override Transformer Engine detection.

    Returns:
        The concrete backend.

    Raises:
        ValueError: ``requested`` is unknown, or it cannot run here (``"local"`` or
            ``"transformer_engine"`` without CUDA, ``"transformer_engine"`` without the
            package); the message names the field and the alternative.
    """
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    te = _transformer_engine_installed() if te_installed is None else te_installed
    if requested not in _BACKENDS:
        raise ValueError(f"model.layer_spec_backend={requested!r} is not one of {list(_BACKENDS)}")
    if requested == "auto":
        if not cuda:
            return "portable"
        return "transformer_engine" if te else "local"
    if requested in ("local", "transformer_engine") and not cuda:
        raise ValueError(
            f"model.layer_spec_backend={requested!r} requires CUDA (megatron's "
            f"{'DotProductAttention' if requested == 'local' else 'Transformer Engine'} "
            "allocates on the GPU); set model.layer_spec_backend='portable' (or 'auto') to "
            "run on CPU"
        )
    if requested == "transformer_engine" and not te:
        raise ValueError(
            "model.layer_spec_backend='transformer_engine' needs Transformer Engine: "
            "pip install bridge-train[te] (or set model.layer_spec_backend='local')"
        )
    return requested  # type: ignore[return-value]


class SequenceParallelTorchNorm:
    """torch's ``LayerNorm`` / ``RMSNorm`` (as megatron's ``WrappedTorchNorm`` builds them)
    for sequence parallelism: its parameters are marked ``sequence_parallel``, so
    megatron's ``finalize_model_grads`` sums their gradients over the tensor-parallel group
    (each rank normed other tokens), as it does for its fused norms.

    Accepts the arguments megatron's layer specs pass to a norm; returns the torch module.
    """

    def __new__(  # type: ignore[misc]
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        # megatron's specs pass the norm settings as arguments, but its torch norm (like this
        # one) reads them from the config: refuse there what torch's norms cannot do.
        for field in (
            "layernorm_zero_centered_gamma",
            "persist_layer_norm",
            "memory_efficient_layer_norm",
        ):
            if getattr(config, field):
                raise ValueError(
                    f"model.{field}=True is not supported by torch's norms (the portable "
                    "layer spec with sequence parallelism); set it to False"
                )
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise ValueError(
                f"model.normalization={config.normalization!r}: the portable layer spec "
                "supports 'LayerNorm' and 'RMSNorm'"
            )
        norm: torch.nn.Module = kinds[config.normalization](hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]
        return norm


def _sequence_parallel_norms(layer: Any) -> Any:
    """A copy of a layer spec whose norms are :class:`SequenceParallelTorchNorm`."""

    layer = copy.deepcopy(layer)
    sub = layer.submodules
    for owner, names in (
        (sub, ("input_layernorm", "pre_mlp_layernorm")),
        (getattr(sub.self_attention, "submodules", None), ("q_layernorm", "k_layernorm")),
    ):
        for name in names:
            if owner is not None and getattr(owner, name, None) is WrappedTorchNorm:
                setattr(owner, name, SequenceParallelTorchNorm)
    return layer


def _portable(spec: Any, provider: Any, vp_stage: int | None) -> Any:
    """Swap SDPA core attention into a layer spec or into every layer of a block spec; with
    sequence parallelism also the norms (a dense model's spec becomes a block spec, whose
    final norm can then be chosen too)."""

    layer_specs = getattr(spec, "layer_specs", None)
    if not provider.sequence_parallel:
        if layer_specs is not None:
            spec.layer_specs = [with_sdpa_core_attention(layer) for layer in layer_specs]
            return spec
        return with_sdpa_core_attention(spec)

    if layer_specs is None:
        layer_specs = [spec] * get_num_layers_to_build(provider, vp_stage=vp_stage)
    return TransformerBlockSubmodules(
        layer_specs=[
            with_sdpa_core_attention(_sequence_parallel_norms(layer)) for layer in layer_specs
        ],
        layer_norm=SequenceParallelTorchNorm,
    )


def _trainable_biased_experts(layer: Any) -> Any:
    """A copy of an MoE layer spec whose local experts' ``linear_fc2`` is
    :class:`~bridge.train.models.expert_linear.ExpertRowParallelLinear` (megatron's biased
    expert MLP otherwise fails its first backward; see that module). Other specs unchanged."""

    layer = copy.deepcopy(layer)
    moe = getattr(layer.submodules, "mlp", None)
    moe_sub = moe.keywords.get("submodules") if isinstance(moe, functools.partial) else None
    experts = getattr(moe_sub, "experts", None)
    if isinstance(experts, functools.partial) and experts.func is SequentialMLP:
        expert_sub = experts.keywords["submodules"]
        if expert_sub.linear_fc2 is RowParallelLinear:
            expert_sub.linear_fc2 = ExpertRowParallelLinear
    return layer


def build_gpt_layer_spec(
    provider: GPTModelProvider,
    backend: Literal["portable", "local", "transformer_engine"],
    vp_stage: int | None = None,
) -> Any:
    """Build the megatron layer spec (or block spec, for MoE) for ``provider``.

    Dense models get one layer spec shared by all layers. MoE models get megatron's
    decoder block spec, which interleaves dense and expert layers per ``moe_layer_freq``
    and holds only the layers of this pipeline stage.

    Args:
        provider: The model config.
        backend: A concrete backend from :func:`resolve_layer_spec_backend`.
        vp_stage: Virtual pipeline stage (for MoE block specs).

    Returns:
        A ``ModuleSpec`` (dense) or ``TransformerBlockSubmodules`` (MoE).

    Raises:
        ValueError: The model uses a feature the portable backend does not support.
    """

    use_te = backend == "transformer_engine"
    if backend == "portable":
        if provider.context_parallel_size > 1:
            raise ValueError(
                f"model.context_parallel_size={provider.context_parallel_size} needs Transformer "
                "Engine attention (megatron engine on CUDA); the portable layer spec supports "
                "context_parallel_size=1 only"
            )
        if provider.num_query_groups % provider.tensor_model_parallel_size:
            raise ValueError(
                f"model.num_query_groups={provider.num_query_groups} is not divisible by "
                f"model.tensor_model_parallel_size={provider.tensor_model_parallel_size}; the "
                "portable layer spec needs whole query groups on every tensor-parallel rank"
            )
    if provider.num_moe_experts is not None:
        spec = gpt_layer_specs.get_gpt_decoder_block_spec(
            provider,
            use_transformer_engine=use_te,
            normalization=provider.normalization,
            vp_stage=vp_stage,
        )
        if provider.add_bias_linear and not use_te:
            spec.layer_specs = [_trainable_biased_experts(layer) for layer in spec.layer_specs]
    elif use_te:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=None,
            moe_grouped_gemm=False,
            qk_layernorm=provider.qk_layernorm,
            multi_latent_attention=provider.multi_latent_attention,
        )
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=None,
            moe_grouped_gemm=False,
            qk_layernorm=provider.qk_layernorm,
            multi_latent_attention=provider.multi_latent_attention,
            normalization=provider.normalization,
        )
    return _portable(spec, provider, vp_stage) if backend == "portable" else spec
