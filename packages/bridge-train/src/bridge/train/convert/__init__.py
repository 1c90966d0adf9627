"""Hugging Face checkpoint import and export (``bridge-convert``; needs ``bridge-train[hf]``).

* :class:`AutoBridge`: the Python API under Megatron-Bridge's names:
  ``AutoBridge.from_hf_pretrained(dir)`` -> ``to_megatron_provider()``,
  ``load_hf_weights(model)`` into a built (tensor/expert/pipeline parallel) model,
  ``save_hf_pretrained(model, dir)``, and the checkpoint conversions ``import_ckpt`` /
  ``export_ckpt`` that ``bridge-convert`` runs.
* :func:`import_hf_checkpoint`: a local Hugging Face model directory (``config.json`` +
  safetensors + tokenizer) -> a bridge-train checkpoint that ``checkpoint.pretrained_checkpoint``
  loads, for any tensor x pipeline x expert parallel layout.
* :func:`export_hf_checkpoint`: a bridge-train checkpoint -> a Hugging Face model directory
  that ``transformers`` loads.
* :func:`provider_from_hf_config`: the provider preset of a ``config.json``.

The families (one module per ``model_type``) live in :mod:`bridge.train.models.families`;
nothing here names one. ``import bridge.train`` does not import this package.
"""

from typing import TYPE_CHECKING

from bridge.train._lazy_exports import lazy_exports

if TYPE_CHECKING:
    from bridge.train.convert.auto_bridge import AutoBridge as AutoBridge
    from bridge.train.convert.exporter import export_hf_checkpoint as export_hf_checkpoint
    from bridge.train.convert.importer import import_hf_checkpoint as import_hf_checkpoint
    from bridge.train.models.families import (
        ConversionError as ConversionError,
        provider_from_hf_config as provider_from_hf_config,
        provider_kwargs_from_hf_config as provider_kwargs_from_hf_config,
        read_hf_config as read_hf_config,
        supported_model_types as supported_model_types,
    )

# Loaded on first use: ``bridge-convert --help`` (this package's cli module) must not pay for
# torch and megatron-core, which the converters import. The TYPE_CHECKING block above is the
# one table of the exports (name -> module).
__all__ = sorted(lazy_exports(globals()))
