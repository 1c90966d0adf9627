"""Reading a Hugging Face ``config.json`` (as a plain dict) into provider fields, refusing what
megatron-core would compute differently.

The helpers every family shares: a required field, the RoPE base and scaling in either the
transformers < 5 spelling (``rope_theta`` + ``rope_scaling``) or the >= 5 one
(``rope_parameters``), activation functions, the stored dtype, and :func:`refuse`, the one
spelling of "this value is not honoured" (``config.json: FIELD=VALUE is not supported for
model_type=...: why``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_mscale
from megatron.core.transformer.utils import is_layer_window_attention

from bridge.train.models.families.errors import ConversionError

__all__ = [
    "DTYPES",
    "LLAMA3_FIXED",
    "attention_layer_types",
    "gelu_tanh",
    "hf_layer_windows",
    "layer_window_kwargs",
    "read_hf_config",
    "refuse",
    "require",
    "rope_or_yarn",
    "rope_settings",
    "rope_theta_and_scaling",
    "silu_activation",
    "torch_dtype_of",
    "yarn_parameters",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# megatron-core's llama3 frequency scaling has these fixed (RotaryEmbedding._apply_scaling).
LLAMA3_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (``gelu_new`` / ``gelu_pytorch_tanh``).

    A named function rather than a ``functools.partial`` so a saved run config names it and
    two providers compare equal.
    """
    return torch.nn.functional.gelu(x, approximate="tanh")


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


def refuse(config: dict[str, Any], field: str, value: Any, why: str) -> ConversionError:
    """The error for a ``config.json`` value a family does not honour (one line)."""
    return ConversionError(
        f"config.json: {field}={value!r} is not supported for "
        f"model_type={config.get('model_type')!r}: {why}"
    )


def require(config: dict[str, Any], key: str) -> Any:
    """``config[key]``, refusing a config without it."""
    if config.get(key) is None:
        raise ConversionError(
            f"config.json (model_type={config.get('model_type')!r}) has no {key!r}; it is not "
            "a complete Hugging Face config"
        )
    return config[key]


def torch_dtype_of(config: dict[str, Any]) -> torch.dtype:
    """The dtype the Hugging Face weights are stored in (``dtype`` / ``torch_dtype``)."""
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    if name not in DTYPES:
        raise ConversionError(
            f"config.json: dtype={name!r} is not one of {sorted(DTYPES)}; convert the weights "
            "to one of them first"
        )
    return DTYPES[name]


def silu_activation(config: dict[str, Any], field: str = "hidden_act") -> Callable[..., Any]:
    """SiLU (the SwiGLU MLP), refusing any other ``hidden_act``."""
    act = config.get(field, "silu")
    if act not in ("silu", "swish"):
        raise refuse(config, field, act, "only 'silu' (the SwiGLU MLP) is implemented")
    return torch.nn.functional.silu


def rope_theta_and_scaling(config: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
    """``(rope_theta, scaling dict or None)`` from either spelling of a one-RoPE config.

    A ``rope_parameters`` dict is the scaling even without a ``rope_theta`` of its own
    (transformers then takes the top-level ``rope_theta``), so its ``rope_type`` is never
    passed over.
    """
    params = config.get("rope_parameters")
    if isinstance(params, dict) and any(k in params for k in ("rope_theta", "rope_type", "type")):
        return params.get("rope_theta", config.get("rope_theta", 10000.0)), params
    return config.get("rope_theta", 10000.0), config.get("rope_scaling")


def rope_settings(
    config: dict[str, Any],
    theta: Any,
    scaling: dict[str, Any] | None,
    *,
    field: str = "rope_scaling",
) -> dict[str, Any]:
    """Provider fields of one RoPE: ``rotary_base`` and its scaling.

    megatron-core implements the ``default``, ``linear`` (position interpolation,
    ``seq_len_interpolation_factor``) and ``llama3`` (``rope_scaling``) frequencies; any
    other type, a ``partial_rotary_factor`` or a non-integer base is refused.
    """
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if float(theta) != int(theta):
        raise refuse(
            config, "rope_theta", theta, "megatron-core's GPTModel takes an integer rotary_base"
        )
    partial = (scaling or {}).get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise refuse(
            config, "partial_rotary_factor", partial, "only fully rotated heads are implemented"
        )
    settings: dict[str, Any] = {"rotary_base": int(theta)}
    if kind == "default":
        return settings
    assert scaling is not None
    if kind == "linear":
        settings["seq_len_interpolation_factor"] = float(scaling["factor"])
        return settings
    if kind == "llama3":
        for key, fixed in LLAMA3_FIXED.items():
            if float(scaling.get(key, fixed)) != float(fixed):
                raise refuse(
                    config,
                    f"{field}.{key}",
                    scaling.get(key),
                    f"megatron-core's llama3 RoPE scaling fixes it at {fixed}",
                )
        settings["rope_scaling"] = True
        settings["rope_scaling_factor"] = float(scaling["factor"])
        return settings
    raise refuse(
        config,
        f"{field}.rope_type",
        kind,
        "megatron-core implements the 'default', 'linear' and 'llama3' RoPE frequencies",
    )


def attention_layer_types(config: dict[str, Any], pattern: int) -> list[str]:
    """The config's ``layer_types`` (``sliding_attention`` or ``full_attention`` per layer),
    or, without it, every ``pattern``-th layer full attention and the others sliding.

    Raises:
        ConversionError: Another layer type, or not one per layer (naming ``layer_types``).
    """
    kinds_known = ("sliding_attention", "full_attention")
    layers = int(config["num_hidden_layers"])
    kinds = config.get("layer_types")
    if kinds is None:
        kinds = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
    unknown = sorted({kind for kind in kinds if kind not in kinds_known})
    if unknown or len(kinds) != layers:
        raise refuse(
            config,
            "layer_types",
            unknown or kinds,
            f"one of {list(kinds_known)} per layer ({layers}) is implemented",
        )
    return list(kinds)


def layer_window_kwargs(config: dict[str, Any], kinds: list[str]) -> dict[str, Any]:
    """``window_size`` and ``window_attn_skip_freq`` for per-layer ``kinds``
    (:func:`attention_layer_types`); none when no layer is ``sliding_attention``."""
    if "sliding_attention" not in kinds:
        return {}
    window = int(require(config, "sliding_window"))
    return {
        "window_size": (window - 1, 0),
        "window_attn_skip_freq": [int(kind == "sliding_attention") for kind in kinds],
    }


def hf_layer_windows(provider: Any) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` of ``config.json`` for a provider's windows
    (what :func:`layer_window_kwargs` reads back)."""
    if provider.window_size is None:
        return {"sliding_window": None, "layer_types": ["full_attention"] * provider.num_layers}
    skip = provider.window_attn_skip_freq
    kinds = [
        "sliding_attention"
        if is_layer_window_attention(provider.window_size, skip, i + 1)
        else "full_attention"
        for i in range(provider.num_layers)
    ]
    return {"sliding_window": int(provider.window_size[0]) + 1, "layer_types": kinds}


def yarn_parameters(
    config: dict[str, Any], scaling: dict[str, Any], *, field: str = "rope_parameters"
) -> dict[str, Any]:
    """The YaRN parameters of ``scaling`` (``rope_parameters`` / ``rope_scaling``) as
    transformers reads them, under their ``config.json`` keys: ``factor`` (derived from
    ``max_position_embeddings / original_max_position_embeddings`` when missing),
    ``original_max_position_embeddings``, ``beta_fast`` / ``beta_slow`` (32 / 1 when unset
    or 0), ``mscale`` / ``mscale_all_dim`` (``None`` when unset) and ``truncate`` (round the
    frequency correction range to whole dimensions).

    megatron-core scales cos and sin by ``mscale(factor, mscale) / mscale(factor,
    mscale_all_dim)`` when both are set and non-zero, else by ``mscale(factor)``, where
    ``mscale(s, m) = 0.1 * m * ln(s) + 1`` (1 for ``s <= 1``; megatron-core's
    ``_yarn_get_mscale``, as transformers computes it): transformers' rule unless
    ``attention_factor`` says otherwise.

    Raises:
        ConversionError: No ``original_max_position_embeddings``, a
            ``partial_rotary_factor`` other than 1, or an ``attention_factor`` other than
            the one megatron-core computes.
    """
    original = scaling.get("original_max_position_embeddings")
    if not original:
        raise refuse(
            config,
            f"{field}.original_max_position_embeddings",
            original,
            "YaRN needs the context length before the extension",
        )
    partial = scaling.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise refuse(
            config, "partial_rotary_factor", partial, "only fully rotated heads are implemented"
        )
    factor = scaling.get("factor")
    if factor is None:
        factor = float(require(config, "max_position_embeddings")) / float(original)
    factor = float(factor)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        computed = _yarn_get_mscale(factor, float(mscale)) / _yarn_get_mscale(
            factor, float(mscale_all_dim)
        )
    else:
        computed = _yarn_get_mscale(factor)
    given = scaling.get("attention_factor")
    if given is not None and not math.isclose(float(given), computed, rel_tol=1e-12):
        raise refuse(
            config,
            f"{field}.attention_factor",
            given,
            f"megatron-core's YaRN scales cos and sin by {computed} (from factor, mscale and "
            "mscale_all_dim)",
        )
    return {
        "factor": factor,
        "original_max_position_embeddings": int(original),
        "beta_fast": float(scaling.get("beta_fast") or 32),
        "beta_slow": float(scaling.get("beta_slow") or 1),
        "mscale": None if mscale is None else float(mscale),
        "mscale_all_dim": None if mscale_all_dim is None else float(mscale_all_dim),
        "truncate": bool(scaling.get("truncate", True)),
    }


def rope_or_yarn(
    config: dict[str, Any], theta: Any, scaling: dict[str, Any] | None, why: str
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``(rotary_base of the plain RoPE, the YaRN parameters or None)`` of a family that
    implements the ``default`` and ``yarn`` RoPE (:func:`rope_settings`,
    :func:`yarn_parameters`); ``why`` ends the refusal of another ``rope_type``."""
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind not in ("default", "yarn"):
        raise refuse(config, "rope_parameters.rope_type", kind, why)
    plain = rope_settings(config, theta, scaling if kind == "default" else None)
    return plain, None if scaling is None or kind == "default" else yarn_parameters(config, scaling)
