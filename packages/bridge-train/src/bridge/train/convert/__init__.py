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

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bridge.train.convert.errors import ConversionError
    from bridge.train.convert.exporter import export_hf_checkpoint
    from bridge.train.convert.hf_config import (
        SUPPORTED_MODEL_TYPES,
        provider_from_hf_config,
        provider_kwargs_from_hf_config,
        read_hf_config,
    )
    from bridge.train.convert.importer import import_hf_checkpoint

# Loaded on first use: ``bridge-convert --help`` (this package's cli module) must not pay for
# torch and megatron-core, which the importer and exporter import.
_MODULE_OF = {
    "ConversionError": "bridge.train.convert.errors",
    "export_hf_checkpoint": "bridge.train.convert.exporter",
    "SUPPORTED_MODEL_TYPES": "bridge.train.convert.hf_config",
    "provider_from_hf_config": "bridge.train.convert.hf_config",
    "provider_kwargs_from_hf_config": "bridge.train.convert.hf_config",
    "read_hf_config": "bridge.train.convert.hf_config",
    "import_hf_checkpoint": "bridge.train.convert.importer",
}

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ConversionError",
    "export_hf_checkpoint",
    "import_hf_checkpoint",
    "provider_from_hf_config",
    "provider_kwargs_from_hf_config",
    "read_hf_config",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
