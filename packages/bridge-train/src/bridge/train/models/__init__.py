"""Model providers: configs that build megatron-core models."""

from bridge.train.models.gpt_provider import GPTModelProvider, calculate_padded_vocab_size
from bridge.train.models.layer_specs import (
    LayerSpecBackend,
    build_gpt_layer_spec,
    resolve_layer_spec_backend,
)
from bridge.train.models.mamba_provider import MambaProvider
from bridge.train.models.t5_provider import T5ModelProvider

__all__ = [
    "GPTModelProvider",
    "LayerSpecBackend",
    "MambaProvider",
    "T5ModelProvider",
    "build_gpt_layer_spec",
    "calculate_padded_vocab_size",
    "resolve_layer_spec_backend",
]
