"""``MambaProvider``: hybrid Mamba / attention / MLP models (megatron-core ``HybridModel``).

The layer pattern uses megatron's symbols: ``M`` Mamba-2 mixer, ``*`` self-attention,
``-`` MLP (``E`` MoE, ``+`` MLA, ``D`` DSA, ``G`` gated delta net need the Transformer
Engine spec). ``"M*M-"`` is a four-layer model: Mamba, attention, Mamba, MLP.

Which implementation of the Mamba mixer runs (``layer_spec_backend``):

``"transformer_engine"``
    megatron-core's own hybrid stack spec: Transformer Engine layers and megatron's
    ``MambaMixer`` with the ``mamba-ssm`` / ``causal-conv1d`` CUDA kernels. Needs CUDA and
    the three packages.
``"portable"``
    :func:`~bridge.train.models.portable_mamba.build_portable_hybrid_stack_spec`: megatron's
    local layers, SDPA attention and a torch Mamba-2 mixer (chunked SSD scan). Any device;
    parameters and checkpoint layout are megatron's.
``"auto"`` (default)
    ``"transformer_engine"`` when CUDA and all three packages are there, else
    ``"portable"``: the fused kernels wherever they can run, a working model everywhere else.

megatron has no non-Transformer-Engine hybrid spec, so ``"local"`` is refused.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols, pattern_from_ratios
from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.transformer.spec_utils import ModuleSpec

from bridge.train.models.gpt_provider import GPTModelProvider
from bridge.train.models.portable_mamba import build_portable_hybrid_stack_spec

__all__ = ["MambaProvider", "resolve_hybrid_backend"]

_PORTABLE_SYMBOLS = frozenset("M*-|")  # "|" separates pipeline stages
_GPU_PACKAGES = ("transformer_engine", "mamba_ssm", "causal_conv1d")


def resolve_hybrid_backend(
    requested: str, *, cuda_available: bool | None = None, missing: list[str] | None = None
) -> Literal["portable", "transformer_engine"]:
    """The hybrid stack implementation ``requested`` resolves to on this machine.

    Args:
        requested: ``"auto"``, ``"portable"`` or ``"transformer_engine"``.
        cuda_available: Override CUDA detection.
        missing: Override the list of missing GPU packages.

    Returns:
        ``"portable"`` or ``"transformer_engine"``.

    Raises:
        ValueError: Unknown value, ``"local"``, or ``"transformer_engine"`` without CUDA or
            without one of its packages (the message names what to install).
    """
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if missing is None:
        missing = [name for name in _GPU_PACKAGES if importlib.util.find_spec(name) is None]
    if requested == "auto":
        return "transformer_engine" if cuda and not missing else "portable"
    if requested == "portable":
        return "portable"
    if requested == "transformer_engine":
        if not cuda:
            raise ValueError(
                "model.layer_spec_backend='transformer_engine' needs CUDA for a Mamba model; "
                "set model.layer_spec_backend='portable' (or 'auto') to run on CPU"
            )
        if missing:
            raise ValueError(
                "model.layer_spec_backend='transformer_engine' for a Mamba model needs "
                f"pip install {' '.join(name.replace('_', '-') for name in missing)} "
                "(or set model.layer_spec_backend='portable')"
            )
        return "transformer_engine"
    if requested == "local":
        raise ValueError(
            "model.layer_spec_backend='local' does not exist for Mamba models (megatron's "
            "hybrid spec is Transformer Engine only); use 'portable', 'transformer_engine' or "
            "'auto'"
        )
    raise ValueError(
        f"model.layer_spec_backend={requested!r} is not one of "
        "['auto', 'portable', 'transformer_engine']"
    )


@dataclass
class MambaProvider(GPTModelProvider):
    """A hybrid Mamba model config that builds megatron-core's ``HybridModel``.

    It is a :class:`~bridge.train.GPTModelProvider` (vocabulary padding, tokenizer,
    tensor-parallel checks, ``finalize``) with the hybrid layer pattern and the Mamba-2
    mixer sizes. The defaults describe a tiny model that trains on a laptop CPU.

    Attributes:
        hybrid_override_pattern: The layer pattern (``"M*M-"``); its layer count must equal
            ``num_layers``. ``None``: megatron derives one from the two ratios.
        hybrid_attention_ratio: Share of attention layers when no pattern is given.
        hybrid_mlp_ratio: Share of MLP layers when no pattern is given.
        mamba_stack_spec: An explicit hybrid stack spec, or a callable ``(provider) ->
            spec``; overrides ``layer_spec_backend``.

    The Mamba-2 sizes are megatron's ``TransformerConfig`` fields: ``mamba_state_dim``,
    ``mamba_head_dim``, ``mamba_num_groups`` and ``mamba_num_heads`` (``None``: twice the
    hidden size divided by the head dimension).
    """

    num_layers: int = 4
    num_attention_heads: int = 4
    hybrid_override_pattern: str | None = None
    hybrid_attention_ratio: float = 0.0
    hybrid_mlp_ratio: float = 0.0
    mamba_stack_spec: ModuleSpec | Callable[..., Any] | None = None
    _user_spec_field: ClassVar[str] = "mamba_stack_spec"
    _fixed_fields: ClassVar[dict[str, tuple[Any, str]]] = {
        "rope_scaling": (False, "by megatron's HybridModel")
    }
    mamba_state_dim: int = 16
    mamba_head_dim: int = 16
    mamba_num_groups: int = 2
    position_embedding_type: Literal["learned_absolute", "rope", "none"] = "none"
    share_embeddings_and_output_weights: bool = False
    normalization: str = "RMSNorm"
    add_bias_linear: bool = False

    def __post_init__(self) -> None:
        """Validate the hybrid fields, then the GPT and megatron checks.

        Raises:
            ValueError: The pattern has unknown symbols or a layer count different from
                ``num_layers``, a ratio is outside [0, 1], or the Mamba sizes do not divide.
        """
        if self.transformer_layer_spec is not None:
            raise ValueError(
                "model.transformer_layer_spec is a GPT field; a Mamba model takes "
                "model.mamba_stack_spec"
            )
        for name in ("hybrid_attention_ratio", "hybrid_mlp_ratio"):
            value = getattr(self, name)
            if not 0.0 <= float(value) <= 1.0:
                raise ValueError(f"model.{name} must be in [0, 1], got {value!r}")
        pattern = self.hybrid_override_pattern
        if pattern is not None:
            main = pattern.split("/")[0].replace("|", "")
            unknown = sorted(set(main) - Symbols.VALID_LAYERS)
            if unknown:
                raise ValueError(
                    f"model.hybrid_override_pattern={pattern!r} has unknown symbols {unknown}; "
                    "use M (Mamba), * (attention), - (MLP) (E, +, D, G need Transformer Engine)"
                )
            if len(main) != self.num_layers:
                raise ValueError(
                    f"model.hybrid_override_pattern={pattern!r} has {len(main)} layers but "
                    f"model.num_layers={self.num_layers}; make them equal"
                )
        self._check_positive("mamba_state_dim", "mamba_head_dim", "mamba_num_groups")
        heads = self.mamba_heads
        tp = self.tensor_model_parallel_size
        if heads % self.mamba_num_groups:
            raise ValueError(
                f"the Mamba mixer has {heads} heads (mamba_num_heads, or 2 x hidden_size / "
                f"mamba_head_dim), not divisible by model.mamba_num_groups="
                f"{self.mamba_num_groups}"
            )
        if tp >= 1 and (heads % tp or self.mamba_num_groups % tp):
            raise ValueError(
                f"model.tensor_model_parallel_size={tp} must divide the Mamba mixer's {heads} "
                f"heads and model.mamba_num_groups={self.mamba_num_groups}"
            )
        super().__post_init__()

    @property
    def mamba_heads(self) -> int:
        """Number of Mamba-2 heads of every mixer.

        Raises:
            ValueError: ``2 x hidden_size`` is not divisible by ``mamba_head_dim`` (with
                ``mamba_num_heads`` unset).
        """
        if self.mamba_num_heads is not None:
            return int(self.mamba_num_heads)
        width = 2 * self.hidden_size
        if width % self.mamba_head_dim:
            raise ValueError(
                f"model.mamba_head_dim={self.mamba_head_dim} does not divide the mixer width "
                f"{width} (2 x hidden_size); change it or set model.mamba_num_heads"
            )
        return width // self.mamba_head_dim

    @property
    def layer_pattern(self) -> str:
        """The layer pattern built (``hybrid_override_pattern`` or derived from the ratios)."""
        if self.hybrid_override_pattern is not None:
            return self.hybrid_override_pattern

        return str(
            pattern_from_ratios(self.num_layers, self.hybrid_attention_ratio, self.hybrid_mlp_ratio)
        )

    def resolved_layer_spec_backend(self) -> Any:
        """The hybrid stack implementation :meth:`provide` builds here (module docstring)."""
        return resolve_hybrid_backend(self.layer_spec_backend)

    def _default_layer_spec(self, vp_stage: int | None) -> Any:
        """The hybrid stack spec of the resolved backend.

        Raises:
            ValueError: The backend cannot run here, or the pattern uses a layer kind the
                portable spec does not build.
        """
        if self.resolved_layer_spec_backend() == "transformer_engine":
            return hybrid_stack_spec
        unsupported = sorted(set(self.layer_pattern.split("/")[0]) - _PORTABLE_SYMBOLS)
        if unsupported:
            raise ValueError(
                f"model.hybrid_override_pattern uses {unsupported}, which the portable hybrid "
                "spec does not build (it has M, *, -); use model.layer_spec_backend="
                "'transformer_engine' on GPU"
            )

        return build_portable_hybrid_stack_spec(self)

    def _build_model(self, vp_stage: int | None, **common: Any) -> Any:
        """megatron's ``HybridModel`` (see :meth:`GPTModelProvider.provide`)."""
        return HybridModel(
            hybrid_stack_spec=self.layer_spec(vp_stage),
            max_sequence_length=self.seq_length,
            hybrid_layer_pattern=self.layer_pattern,
            rotary_base=self.rotary_base,
            scatter_embedding_sequence_parallel=self.scatter_embedding_sequence_parallel,
            vp_stage=vp_stage,
            **common,
        )
