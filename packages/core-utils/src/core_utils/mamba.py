"""Inference-state configuration of hybrid (Mamba + attention) models."""

from __future__ import annotations

from typing import Any

from core_utils._megatron import import_megatron
from core_utils.model_wrapping import get_attr_wrapped_model

__all__ = ["get_mamba_inference_state_config_from_model"]

_CALLER = "get_mamba_inference_state_config_from_model"
# megatron-core's Symbols.MAMBA in every release's hybrid layer pattern.
_MAMBA = "M"


def _config_class() -> Any:
    for module in (
        "megatron.core.inference.config",
        "megatron.core.inference.contexts.attention_context.mamba_metadata",
    ):
        try:
            cls = getattr(import_megatron(module, _CALLER), "MambaInferenceStateConfig", None)
        except ImportError:
            continue
        if cls is not None:
            return cls
    raise ImportError(
        f"{_CALLER} needs megatron-core's MambaInferenceStateConfig "
        "(megatron.core.inference.config); install megatron-core >= 0.15"
    )


def get_mamba_inference_state_config_from_model(model: Any) -> Any:
    """Return the Mamba inference-state config of a hybrid model, or ``None``.

    A model is hybrid when its (possibly wrapped) ``decoder`` has a ``layer_type_list``
    containing a Mamba layer. For any other model ``None`` is returned without importing
    megatron-core.

    Args:
        model: A model, possibly wrapped (DDP, Float16Module, ...).

    Returns:
        megatron-core's ``MambaInferenceStateConfig`` (layer types, conv/SSM state shapes
        per request, their dtypes = the model's ``params_dtype``, and the Mamba chunk
        size), or ``None`` for a non-hybrid model.

    Raises:
        ImportError: The model is hybrid but megatron-core is not installed.
    """
    try:
        decoder = get_attr_wrapped_model(model, "decoder")
    except RuntimeError:
        return None
    layer_type_list = getattr(decoder, "layer_type_list", None)
    if not layer_type_list or _MAMBA not in layer_type_list:
        return None
    config_cls = _config_class()
    # The level that holds the decoder is the model proper; its config may sit on a wrapper.
    inner = get_attr_wrapped_model(model, "decoder", return_model_obj=True)
    params_dtype = get_attr_wrapped_model(model, "config", allow_none=False).params_dtype
    from_model = getattr(config_cls, "from_model", None)
    if from_model is not None:
        return from_model(inner, conv_states_dtype=params_dtype, ssm_states_dtype=params_dtype)
    conv_shape, ssm_shape = decoder.mamba_state_shapes_per_request()
    chunk_size = 128
    for layer_type, layer in zip(layer_type_list, decoder.layers, strict=False):
        if layer_type == _MAMBA and hasattr(layer, "mixer"):
            chunk_size = layer.mixer.chunk_size
            break
    return config_cls(
        layer_type_list=layer_type_list,
        conv_states_shape=conv_shape,
        ssm_states_shape=ssm_shape,
        conv_states_dtype=params_dtype,
        ssm_states_dtype=params_dtype,
        mamba_chunk_size=chunk_size,
    )
