"""Hugging Face model families: one module per ``model_type``.

Each module here defines an :class:`HFFamily` subclass registered with
:func:`register_family`: how its ``config.json`` maps to the provider and how each weight
maps (import and export). The registry imports every module of this package on first use,
so adding a family is adding one file (and its test file; see docs/models.md).
``bridge.train.convert`` (the importer, exporter, streaming, :class:`AutoBridge` and
``bridge-convert``) knows no family by name.

Nothing here imports ``safetensors`` or ``transformers``.
"""

from bridge.train.models.families.base import (
    ARCHITECTURE_FIELDS,
    HFFamily,
    architecture_mismatches,
    family_for,
    match_family,
    provider_from_hf_config,
    provider_kwargs_from_hf_config,
    register_family,
    registered_families,
    supported_model_types,
)
from bridge.train.models.families.config_fields import read_hf_config, torch_dtype_of
from bridge.train.models.families.errors import ConversionError
from bridge.train.models.families.mapping import ParamMapping

__all__ = [
    "ARCHITECTURE_FIELDS",
    "ConversionError",
    "HFFamily",
    "ParamMapping",
    "architecture_mismatches",
    "family_for",
    "match_family",
    "provider_from_hf_config",
    "provider_kwargs_from_hf_config",
    "read_hf_config",
    "register_family",
    "registered_families",
    "supported_model_types",
    "torch_dtype_of",
]
