"""Specs of a small vision-language MIMO model that trains on CPU.

A :class:`~bridge.mimo.vision.PatchEncoder` (bidirectional megatron layers) with a
:class:`~bridge.mimo.vision.ProjectionMLP` feeds a megatron-core ``GPTModel`` (learned positions,
SDPA core attention). :func:`tiny_vlm_specs` returns the arguments of
:func:`~bridge.mimo.build_mimo_model` for a given infra, with each module's
tensor-parallel size taken from the layout. Used by the example, the tests, and as the
model of bridge-train's ``mimo`` recipe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.mimo import VisionModalitySubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from bridge.mimo.infra import MegatronMIMOInfra
from bridge.mimo.vision import PatchEncoder, ProjectionMLP
from core_utils.portable_attention import with_sdpa_core_attention

__all__ = ["TinyVLMConfig", "tiny_vlm_specs"]


@dataclass(frozen=True)
class TinyVLMConfig:
    """Sizes of the tiny vision-language model.

    Attributes:
        vocab_size: Language-model vocabulary size.
        seq_length: Language-model sequence length (image tokens + text).
        language_hidden_size: Language-model width.
        language_layers: Language-model transformer layers.
        language_heads: Language-model attention heads.
        encoder_hidden_size: Vision-encoder width.
        encoder_layers: Vision-encoder transformer layers.
        encoder_heads: Vision-encoder attention heads.
        image_size: Side of the square input images.
        patch_size: Side of a patch (one image token per patch).
        channels: Image channels.
        image_token_id: Token id that marks image positions in the input ids.
        vision_module: Name of the vision module in the layout.
        encoder_name: Name of the encoder inside the vision module.
        perform_initialization: megatron's ``perform_initialization`` of both transformer
            configs (``False``: the caller draws the weights, as bridge-train's
            layout-independent initialisation does).
    """

    vocab_size: int = 32
    seq_length: int = 24
    language_hidden_size: int = 64
    language_layers: int = 2
    language_heads: int = 4
    encoder_hidden_size: int = 64
    encoder_layers: int = 2
    encoder_heads: int = 4
    image_size: int = 16
    patch_size: int = 4
    channels: int = 3
    image_token_id: int = 3
    vision_module: str = "vision"
    encoder_name: str = "patch_encoder"
    perform_initialization: bool = True

    @property
    def image_tokens(self) -> int:
        """Image tokens (patches) per image."""
        return (self.image_size // self.patch_size) ** 2


def _transformer_config(
    layers: int, hidden: int, heads: int, tp: int, **overrides: Any
) -> TransformerConfig:
    return TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **overrides,
    )


def tiny_vlm_specs(config: TinyVLMConfig, infra: MegatronMIMOInfra) -> dict[str, Any]:
    """Keyword arguments of :func:`~bridge.mimo.build_mimo_model` for the tiny VLM.

    Args:
        config: Model sizes.
        infra: The job's infra; its layout must have ``config.vision_module`` and the
            language module.

    Returns:
        ``{"language_model_spec", "modality_submodules_spec", "special_token_ids"}``.

    Raises:
        ValueError: The layout's modules do not match the config.
    """
    expected = {config.vision_module, infra.language_module_name}
    if set(infra.module_to_grid_map) != expected:
        raise ValueError(
            f"the tiny VLM has modules {sorted(expected)}, the layout has "
            f"{sorted(infra.module_to_grid_map)}"
        )
    language_config = _transformer_config(
        config.language_layers,
        config.language_hidden_size,
        config.language_heads,
        infra.tp_size(infra.language_module_name),
        perform_initialization=config.perform_initialization,
    )
    language_model_spec = ModuleSpec(
        module=GPTModel,
        params={
            "config": language_config,
            "transformer_layer_spec": with_sdpa_core_attention(get_gpt_layer_local_spec()),
            "vocab_size": config.vocab_size,
            "max_sequence_length": config.seq_length,
            # Learned absolute positions: megatron-core 0.19.2's RoPE moves its frequencies
            # to torch.cuda.current_device() on first use, which fails on CPU.
            "position_embedding_type": "learned_absolute",
        },
    )
    encoder_config = _transformer_config(
        config.encoder_layers,
        config.encoder_hidden_size,
        config.encoder_heads,
        infra.tp_size(config.vision_module),
        perform_initialization=config.perform_initialization,
    )
    vision_spec = ModuleSpec(
        module=VisionModalitySubmodules,
        submodules={
            "encoders": {
                config.encoder_name: ModuleSpec(
                    module=PatchEncoder,
                    params={
                        "config": encoder_config,
                        "image_size": config.image_size,
                        "patch_size": config.patch_size,
                        "in_channels": config.channels,
                    },
                )
            },
            "input_projections": [
                ModuleSpec(
                    module=ProjectionMLP,
                    params={
                        "input_size": config.encoder_hidden_size,
                        "output_size": config.language_hidden_size,
                    },
                )
            ],
        },
    )
    return {
        "language_model_spec": language_model_spec,
        "modality_submodules_spec": {config.vision_module: vision_spec},
        "special_token_ids": {config.vision_module: config.image_token_id},
    }
