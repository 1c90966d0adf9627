"""Hugging Face checkpoint import and export (``bridge-convert``; needs ``bridge-train[hf]``).

* :func:`import_hf_checkpoint`: a local Hugging Face model directory (``config.json`` +
  safetensors + tokenizer) -> a bridge-train checkpoint that ``checkpoint.pretrained_checkpoint``
  loads, for any tensor x pipeline parallel layout.
* :func:`export_hf_checkpoint`: a bridge-train checkpoint -> a Hugging Face model directory
  that ``transformers`` loads.
* :func:`provider_from_hf_config`: the GPT-provider preset of a ``config.json`` (Llama 2/3,
  Mistral, Qwen2/2.5, GPT-2).

``import bridge.train`` does not import this package.
"""

from bridge.train.convert.errors import ConversionError
from bridge.train.convert.exporter import export_hf_checkpoint
from bridge.train.convert.hf_config import (
    SUPPORTED_MODEL_TYPES,
    provider_from_hf_config,
    provider_kwargs_from_hf_config,
    read_hf_config,
)
from bridge.train.convert.importer import import_hf_checkpoint

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ConversionError",
    "export_hf_checkpoint",
    "import_hf_checkpoint",
    "provider_from_hf_config",
    "provider_kwargs_from_hf_config",
    "read_hf_config",
]
