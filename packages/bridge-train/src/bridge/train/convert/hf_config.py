"""GPT-provider presets built from a Hugging Face ``config.json`` (read as plain JSON).

Supported ``model_type`` values and what each sets on :class:`GPTModelProvider`:

* ``llama`` (Llama 2 and 3, including ``rope_scaling`` of type ``llama3`` and ``linear``),
  ``mistral`` (sliding-window attention when ``sliding_window`` is set) and ``qwen2``
  (Qwen2 / Qwen2.5: bias on the query, key and value projections): rotary position
  embeddings, RMSNorm, SwiGLU MLP (``gated_linear_unit`` with SiLU), grouped-query
  attention (``num_key_value_heads``), no other biases, tied or untied embeddings.
* ``gpt2``: learned absolute positions, LayerNorm with bias, GELU (tanh approximation for
  ``gelu_new``), biases on every linear layer, tied embeddings.

A setting megatron-core cannot express (for example a RoPE scaling type it has no
implementation for, or a bias on the attention output without one on the MLP) is refused
with a :class:`ConversionError` naming the field, never ignored.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bridge.train.convert.errors import ConversionError

__all__ = [
    "LLAMA_LIKE_MODEL_TYPES",
    "SUPPORTED_MODEL_TYPES",
    "provider_from_hf_config",
    "provider_kwargs_from_hf_config",
    "read_hf_config",
    "torch_dtype_of",
]

LLAMA_LIKE_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_MODEL_TYPES = (*LLAMA_LIKE_MODEL_TYPES, "gpt2")

# megatron-core's llama3 frequency scaling has these fixed (RotaryEmbedding._apply_scaling).
_LLAMA3_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face model directory as a dict.

    Raises:
        ConversionError: The directory or its ``config.json`` is missing or not JSON.
    """
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ConversionError(f"{model_dir} is not a directory (expected a Hugging Face model)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConversionError(
            f"{path} is missing: a Hugging Face model directory holds config.json next to its "
            "safetensors files"
        ) from None
    except (OSError, ValueError) as exc:
        raise ConversionError(f"{path} cannot be read as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path} does not hold a JSON object")
    return data


def torch_dtype_of(config: dict[str, Any]) -> torch.dtype:
    """The dtype the Hugging Face weights are stored in (``dtype`` / ``torch_dtype``)."""
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    if name not in _DTYPES:
        raise ConversionError(
            f"config.json: dtype={name!r} is not one of {sorted(_DTYPES)}; convert the weights "
            "to one of them first"
        )
    return _DTYPES[name]


def _require(config: dict[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise ConversionError(
            f"config.json (model_type={config.get('model_type')!r}) has no {key!r}; it is not "
            "a complete Hugging Face config"
        )
    return config[key]


def _rope_settings(config: dict[str, Any]) -> dict[str, Any]:
    """RoPE base and scaling from either the transformers<5 or the >=5 spelling."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = params["rope_theta"]
        scaling: dict[str, Any] | None = params
    else:
        theta = config.get("rope_theta", 10000.0)
        scaling = config.get("rope_scaling")
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if float(theta) != int(theta):
        raise ConversionError(
            f"config.json: rope_theta={theta} is not a whole number; megatron-core's "
            "GPTModel takes an integer rotary_base"
        )
    settings: dict[str, Any] = {"rotary_base": int(theta)}
    if kind == "default":
        return settings
    assert scaling is not None
    if kind == "linear":
        settings["seq_len_interpolation_factor"] = float(scaling["factor"])
        return settings
    if kind == "llama3":
        for key, fixed in _LLAMA3_FIXED.items():
            if float(scaling.get(key, fixed)) != float(fixed):
                raise ConversionError(
                    f"config.json: rope_scaling {key}={scaling.get(key)} is not supported: "
                    f"megatron-core's llama3 RoPE scaling fixes it at {fixed}"
                )
        settings["rope_scaling"] = True
        settings["rope_scaling_factor"] = float(scaling["factor"])
        return settings
    raise ConversionError(
        f"config.json: rope_scaling type {kind!r} is not supported (megatron-core implements "
        "'default', 'linear' and 'llama3')"
    )


def _llama_activation(config: dict[str, Any]) -> Callable[..., Any]:
    act = config.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConversionError(
            f"config.json: hidden_act={act!r} is not supported for "
            f"model_type={config['model_type']!r} (only 'silu', the SwiGLU MLP)"
        )
    return torch.nn.functional.silu


def _gpt2_activation(name: str) -> Callable[..., Any]:
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return functools.partial(torch.nn.functional.gelu, approximate="tanh")
    if name == "gelu":
        return torch.nn.functional.gelu
    if name == "relu":
        return torch.nn.functional.relu
    raise ConversionError(
        f"config.json: activation_function={name!r} is not supported for gpt2 (use gelu_new, "
        "gelu_pytorch_tanh, gelu or relu)"
    )


def _llama_like(config: dict[str, Any]) -> dict[str, Any]:
    model_type = config["model_type"]
    heads = int(_require(config, "num_attention_heads"))
    hidden = int(_require(config, "hidden_size"))
    kwargs: dict[str, Any] = {
        "num_layers": int(_require(config, "num_hidden_layers")),
        "hidden_size": hidden,
        "ffn_hidden_size": int(_require(config, "intermediate_size")),
        "num_attention_heads": heads,
        "num_query_groups": int(config.get("num_key_value_heads") or heads),
        "kv_channels": int(config.get("head_dim") or hidden // heads),
        "vocab_size": int(_require(config, "vocab_size")),
        "share_embeddings_and_output_weights": bool(config.get("tie_word_embeddings", False)),
        "position_embedding_type": "rope",
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(config.get("rms_norm_eps", 1e-6)),
        "gated_linear_unit": True,
        "activation_func": _llama_activation(config),
        "add_bias_linear": False,
        "add_qkv_bias": model_type == "qwen2",
        "attention_dropout": float(config.get("attention_dropout", 0.0)),
        "hidden_dropout": 0.0,
        **_rope_settings(config),
    }
    if model_type == "llama":
        attention_bias = bool(config.get("attention_bias", False))
        mlp_bias = bool(config.get("mlp_bias", False))
        if attention_bias != mlp_bias:
            raise ConversionError(
                f"config.json: attention_bias={attention_bias} with mlp_bias={mlp_bias} is not "
                "supported: megatron-core puts a bias on every linear layer or on none "
                "(add_bias_linear)"
            )
        kwargs["add_bias_linear"] = attention_bias
    if model_type == "qwen2" and config.get("use_sliding_window"):
        raise ConversionError(
            "config.json: use_sliding_window=true is not supported for qwen2 (sliding windows "
            "on only some layers, max_window_layers); set it to false if the model was trained "
            "without it"
        )
    if model_type == "mistral" and config.get("sliding_window") is not None:
        # Hugging Face attends to the `sliding_window` newest keys including the query's own
        # position: megatron's (left, right) window is (sliding_window - 1, 0).
        kwargs["window_size"] = (int(config["sliding_window"]) - 1, 0)
    return kwargs


def _gpt2(config: dict[str, Any]) -> dict[str, Any]:
    for key in ("add_cross_attention", "scale_attn_by_inverse_layer_idx"):
        if config.get(key):
            raise ConversionError(f"config.json: {key}=true is not supported for gpt2")
    hidden = int(_require(config, "n_embd"))
    return {
        "num_layers": int(_require(config, "n_layer")),
        "hidden_size": hidden,
        "ffn_hidden_size": int(config.get("n_inner") or 4 * hidden),
        "num_attention_heads": int(_require(config, "n_head")),
        "vocab_size": int(_require(config, "vocab_size")),
        "seq_length": int(_require(config, "n_positions")),
        "share_embeddings_and_output_weights": bool(config.get("tie_word_embeddings", True)),
        "position_embedding_type": "learned_absolute",
        "normalization": "LayerNorm",
        "layernorm_epsilon": float(config.get("layer_norm_epsilon", 1e-5)),
        "gated_linear_unit": False,
        "activation_func": _gpt2_activation(config.get("activation_function", "gelu_new")),
        "add_bias_linear": True,
        "add_qkv_bias": True,
        "hidden_dropout": float(config.get("resid_pdrop", 0.1)),
        "attention_dropout": float(config.get("attn_pdrop", 0.1)),
    }


def provider_kwargs_from_hf_config(config: dict[str, Any]) -> dict[str, Any]:
    """The :class:`GPTModelProvider` fields that describe the architecture of ``config``.

    Args:
        config: A Hugging Face ``config.json`` as a dict.

    Returns:
        Keyword arguments for ``GPTModelProvider`` (architecture only: no parallel layout).

    Raises:
        ConversionError: Unknown ``model_type`` or a setting megatron-core cannot express.
    """
    model_type = config.get("model_type")
    if model_type in LLAMA_LIKE_MODEL_TYPES:
        kwargs = _llama_like(config)
    elif model_type == "gpt2":
        kwargs = _gpt2(config)
    else:
        raise ConversionError(
            f"config.json: model_type={model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    # Fused CUDA kernels are off so the same config runs on CPU; enable them for GPU runs.
    kwargs.update(
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )
    return kwargs


def provider_from_hf_config(
    config: dict[str, Any] | str | Path,
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    make_vocab_size_divisible_by: int = 128,
    seq_length: int | None = None,
    **overrides: Any,
) -> Any:
    """A :class:`~bridge.train.models.GPTModelProvider` for a Hugging Face model.

    Args:
        config: ``config.json`` as a dict, or the model directory holding it.
        tensor_model_parallel_size: Tensor-parallel size of the provider.
        pipeline_model_parallel_size: Pipeline-parallel size of the provider.
        make_vocab_size_divisible_by: Vocabulary padding granularity per TP rank.
        seq_length: Training sequence length. Default: ``max_position_embeddings`` capped at
            4096 for rotary models; GPT-2 always uses ``n_positions`` (its learned position
            table has that many rows).
        **overrides: Any other provider field.

    Returns:
        The provider.

    Raises:
        ConversionError: Unsupported architecture, or a parallel layout the model does not
            divide into (the message names the field).
    """
    from bridge.train.models import GPTModelProvider

    if not isinstance(config, dict):
        config = read_hf_config(config)
    kwargs = provider_kwargs_from_hf_config(config)
    if kwargs["position_embedding_type"] == "rope":
        default = min(int(config.get("max_position_embeddings") or 4096), 4096)
        kwargs["seq_length"] = int(seq_length or default)
    elif seq_length is not None and seq_length != kwargs["seq_length"]:
        raise ConversionError(
            f"seq_length={seq_length}: gpt2 has learned positions for exactly n_positions="
            f"{kwargs['seq_length']} tokens; train with sequences up to that length instead"
        )
    kwargs.update(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
    )
    if pipeline_model_parallel_size > 1:
        # megatron refuses pipeline parallelism without the dtype of the tensors the stages
        # exchange: the activations' dtype, i.e. the parameters' unless overridden.
        kwargs["pipeline_dtype"] = kwargs.get("params_dtype", torch.float32)
    kwargs.update(overrides)
    try:
        return GPTModelProvider(**kwargs)
    except ValueError as exc:
        raise ConversionError(str(exc).splitlines()[0]) from None
