"""The ``mimo`` recipe's model config: a tiny vision-language MIMO model and its layout.

:class:`MimoModelConfig` is the ``model`` section of ``bridge-train --recipe mimo``
(bridge.mimo's tiny vision-language model: a patch encoder feeding a megatron GPT);
:func:`mimo_layout` places its two modules on the ranks of a job (``model.layout``):

* ``auto`` (default): one rank: both modules colocated; an even number ``W >= 2`` of ranks:
  the vision encoder data-parallel on ranks ``0 .. W/2-1`` and the language model on ranks
  ``W/2 .. W-1`` (tensor parallel 2 when ``model.language_parallel=tp`` and ``W/2`` is even,
  else data parallel);
* ``colocated``: both modules on every rank, data parallel over all of them;
* ``split``: the non-colocated layout above (needs an even world size).

The run itself is :func:`bridge.train.loop.pretrain_mimo.pretrain_mimo`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch

import bridge.mimo as mimo
from bridge.config import ConfigError
from bridge.train.models.layout_init import initialize_layout_independent

__all__ = ["MimoModelConfig", "build_mimo_recipe_model", "mimo_layout"]


@dataclass(kw_only=True)
class MimoModelConfig:
    """Model and layout of the ``mimo`` recipe (satisfies ``ModelConfigProtocol``).

    The protocol's sizes (``num_layers``, ``hidden_size``, ``num_attention_heads``,
    ``seq_length``) describe the language model. Per-module parallelism comes from
    ``layout`` / ``language_parallel``; the container-wide parallel sizes must stay 1.
    """

    num_layers: int = 2
    """Language-model transformer layers."""

    hidden_size: int = 64
    """Language-model width."""

    num_attention_heads: int = 4
    """Language-model attention heads."""

    seq_length: int = 24
    """Language-model sequence length (image tokens plus caption)."""

    vocab_size: int = 32
    """Language-model vocabulary size."""

    encoder_hidden_size: int = 64
    """Vision-encoder width."""

    encoder_layers: int = 2
    """Vision-encoder transformer layers."""

    encoder_heads: int = 4
    """Vision-encoder attention heads."""

    image_size: int = 16
    """Side of the square synthetic images."""

    patch_size: int = 4
    """Side of a patch (one image token per patch)."""

    channels: int = 3
    """Image channels."""

    num_classes: int = 8
    """Image classes of the synthetic data (each has a two-token name in the caption)."""

    num_samples: int = 4096
    """Size of the synthetic dataset (epochs are reshuffled)."""

    layout: Literal["auto", "colocated", "split"] = "auto"
    """Where the modules run (see the module docstring)."""

    language_parallel: Literal["tp", "dp"] = "tp"
    """Parallelism of the language model in the split layout: tensor parallel 2 (when its
    rank count is even) or data parallel."""

    communicator: Literal["auto", "p2p", "megatron"] = "auto"
    """Cross-module data path: ``auto`` (megatron-core's BridgeCommunicator when the job runs
    on CUDA and the layout fits it, else ``p2p``), ``p2p`` (torch.distributed point-to-point;
    CPU and GPU) or ``megatron`` (megatron-core's; CUDA only)."""

    tensor_model_parallel_size: int = 1
    """Must be 1: per-module tensor parallelism comes from ``language_parallel``."""

    pipeline_model_parallel_size: int = 1
    """Must be 1 (bridge.mimo does not pipeline)."""

    virtual_pipeline_model_parallel_size: int | None = None
    """Must be unset."""

    context_parallel_size: int = 1
    """Must be 1."""

    expert_model_parallel_size: int = 1
    """Must be 1."""

    params_dtype: torch.dtype = torch.float32
    """Parameter dtype (fp32; the tiny VLM is trained in full precision)."""

    bf16: bool = False
    """Must be false."""

    fp16: bool = False
    """Must be false."""

    def __post_init__(self) -> None:
        """Check the sizes and that the container-wide parallel settings are unused."""
        # Every int field is a size or a parallel size (the latter checked to be 1 below).
        # The annotation is the string "int" under this module's postponed annotations.
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type in ("int", int) and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ValueError(f"model.{field.name} must be a positive integer, got {value!r}")
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
        ):
            if getattr(self, name) != 1:
                raise ValueError(
                    f"model.{name}={getattr(self, name)}: the mimo recipe sets parallelism per "
                    "module; use model.layout and model.language_parallel instead"
                )
        if self.virtual_pipeline_model_parallel_size is not None:
            raise ValueError("model.virtual_pipeline_model_parallel_size must be unset")
        if self.bf16 or self.fp16 or self.params_dtype != torch.float32:
            raise ValueError("the mimo recipe trains in fp32: unset model.bf16 / model.fp16")
        if self.image_size % self.patch_size:
            raise ValueError(
                f"model.image_size={self.image_size} is not a multiple of "
                f"model.patch_size={self.patch_size}"
            )

    def tiny_vlm_config(self) -> Any:
        """bridge.mimo's ``TinyVLMConfig`` with these sizes."""

        return mimo.TinyVLMConfig(
            vocab_size=self.vocab_size,
            seq_length=self.seq_length,
            language_hidden_size=self.hidden_size,
            language_layers=self.num_layers,
            language_heads=self.num_attention_heads,
            encoder_hidden_size=self.encoder_hidden_size,
            encoder_layers=self.encoder_layers,
            encoder_heads=self.encoder_heads,
            image_size=self.image_size,
            patch_size=self.patch_size,
            channels=self.channels,
        )


def mimo_layout(model: MimoModelConfig, world_size: int) -> Any:
    """The ``bridge.mimo.MimoLayout`` of ``model.layout`` for ``world_size`` ranks.

    Raises:
        ConfigError: The layout cannot be built for this world size.
    """

    kind = model.layout
    if kind == "auto":
        kind = "colocated" if world_size == 1 else "split"
    if kind == "colocated":
        everywhere = mimo.ModulePlacement(ranks=range(world_size), dp=world_size)
        return mimo.MimoLayout({"vision": everywhere, "language": everywhere})
    if world_size < 2 or world_size % 2:
        raise ConfigError(
            "model.layout",
            f"the split layout puts the encoder and the language model on half of the ranks "
            f"each and needs an even world size >= 2, got {world_size}; use "
            "model.layout=colocated or launch an even number of ranks",
        )
    half = world_size // 2
    tp = 2 if model.language_parallel == "tp" and half % 2 == 0 else 1
    return mimo.MimoLayout(
        {
            "vision": mimo.ModulePlacement(ranks=range(0, half), dp=half),
            "language": mimo.ModulePlacement(ranks=range(half, world_size), tp=tp),
        }
    )


def build_mimo_recipe_model(
    model: MimoModelConfig, infra: Any, seed: int, layout_seed: int | None
) -> Any:
    """Build this rank's modules of the tiny vision-language model (on the CPU).

    Args:
        model: The ``model`` section.
        infra: bridge.mimo's infra of the job's layout.
        seed: ``rng.seed`` (bridge.mimo seeds each leaf module's draw from it).
        layout_seed: The seed of layout-independent initialisation
            (:func:`~bridge.train.models.layout_init.layout_independent_seed`), or ``None``.
            When set, megatron's own draw is skipped and every module's shards are drawn
            from their sharded keys, each module with its own config's init methods (the
            vision encoder's and the language model's), so every module layout starts from
            the same weights with no rank drawing more than its shards plus one tile.

    Returns:
        bridge.mimo's ``MimoModel``.
    """
    vlm = model.tiny_vlm_config()
    if layout_seed is not None:
        vlm = dataclasses.replace(vlm, perform_initialization=False)
    built = mimo.build_mimo_model(infra, init_seed=seed, **mimo.tiny_vlm_specs(vlm, infra))
    if layout_seed is not None:
        initialize_layout_independent([built], None, layout_seed)
    return built
