"""A Hugging Face model family: how its ``config.json`` maps to a provider, and how each
weight maps, in both directions.

A family is a subclass of :class:`HFFamily` registered for its ``model_type`` values with
:func:`register_family`. Everything else (the importer, the exporter, streaming,
:class:`~bridge.train.convert.AutoBridge`, ``bridge-convert``) finds it through
:func:`family_for` and knows no family by name. Besides the two mappings a family says
which class builds its model (``provider_class``, a :class:`GPTModelProvider` unless the
family needs modules megatron-core lacks), which prefixes its checkpoints' tensor names
carry, and, for exporting a model trained from scratch, the ``config.json`` a provider
stands for (:meth:`HFFamily.hf_config`).

A provider matches a family when the provider that family builds from the config it would
write has the same value for every field in :data:`ARCHITECTURE_FIELDS` (the fields that
change what the model computes); :func:`match_family` picks the first such family and
names the differing fields when there is none.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import Any, ClassVar

from bridge.train.models.architecture import ARCHITECTURE_FIELDS, same_setting, show_setting
from bridge.train.models.families.config_fields import read_hf_config
from bridge.train.models.families.errors import ConversionError
from bridge.train.models.families.mapping import ParamMapping
from bridge.train.models.gpt_provider import GPTModelProvider

__all__ = [
    "ARCHITECTURE_FIELDS",
    "HFFamily",
    "architecture_mismatches",
    "family_for",
    "match_family",
    "provider_from_hf_config",
    "provider_kwargs_from_hf_config",
    "register_family",
    "registered_families",
    "same_setting",
    "supported_model_types",
]

# megatron's CUDA-only fusions, off so the same provider runs on CPU (set them back for GPUs).
_CPU_SAFE = {
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "apply_rope_fusion": False,
    "masked_softmax_fusion": False,
    "persist_layer_norm": False,
    "gradient_accumulation_fusion": False,
}


class HFFamily:
    """How one Hugging Face architecture maps to megatron-core (subclass and register it).

    Attributes:
        model_types: The ``model_type`` values of ``config.json`` this family reads.
        architecture: The transformers class written to an exported ``config.json``.
        hf_prefixes: Prefixes of the checkpoint's tensor names, most common first (the
            one whose embedding is present is used).
        embedding: The embedding's name after the prefix (to detect the prefix).
        positions_field: The config field giving the length of learned position tables.
        provider_class: The provider class the family builds.
    """

    model_types: ClassVar[tuple[str, ...]] = ()
    architecture: ClassVar[str] = ""
    hf_prefixes: ClassVar[tuple[str, ...]] = ("model.", "")
    embedding: ClassVar[str] = "embed_tokens.weight"
    positions_field: ClassVar[str] = "max_position_embeddings"
    provider_class: ClassVar[type[GPTModelProvider]] = GPTModelProvider

    @property
    def name(self) -> str:
        """The family's main ``model_type``."""
        return self.model_types[0]

    def text_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The part of ``config`` that describes the language model (default: all of it)."""
        return config

    def provider_kwargs(self, config: dict[str, Any]) -> dict[str, Any]:
        """Provider fields (architecture only, no parallel layout) of ``config``.

        Raises:
            ConversionError: A field the family does not honour (one line naming it).
        """
        raise NotImplementedError

    def param_mappings(
        self, config: dict[str, Any], padded_vocab: int, prefix: str
    ) -> list[ParamMapping]:
        """Every parameter of the one-process megatron model with its Hugging Face sources.

        Args:
            config: The language-model config (:meth:`text_config`).
            padded_vocab: Rows of the megatron embedding and output layer.
            prefix: Prefix of the Hugging Face tensor names.
        """
        raise NotImplementedError

    def ignores(self, name: str) -> bool:
        """Whether a checkpoint tensor is not a weight of the imported model (a buffer)."""
        return name.endswith("rotary_emb.inv_freq")

    def skips(self, name: str, config: dict[str, Any]) -> bool:
        """Whether a checkpoint tensor belongs to a part of the model this family does not
        import (a multimodal model's vision tower, layers the Hugging Face model does not
        run); the importer reports how many.

        Args:
            name: The tensor's name.
            config: The language-model config (:meth:`text_config`).
        """
        return False

    def detect_prefix(self, names: set[str]) -> str:
        """The prefix of ``names`` (the checkpoint's tensor names)."""
        present = (prefix for prefix in self.hf_prefixes if f"{prefix}{self.embedding}" in names)
        return next(present, self.hf_prefixes[0])

    def export_config(
        self, config: dict[str, Any], imported_prefix: str | None
    ) -> tuple[dict[str, Any], str]:
        """The ``config.json`` and tensor-name prefix an export of an import writes.

        Default: the source's config and the prefix its tensors had (the family's first
        prefix when unknown). A family that imports only part of a model (the text model of
        a multimodal one) returns the config of that part.
        """
        return config, self.hf_prefixes[0] if imported_prefix is None else imported_prefix

    def hf_config(self, provider: Any) -> dict[str, Any]:
        """The ``config.json`` this family writes for ``provider`` (a model trained from
        scratch). :func:`match_family` checks that the family reads it back to ``provider``.
        """
        raise NotImplementedError

    def generation_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """A ``generation_config.json`` for an export whose source had none."""
        return {
            key: config[key]
            for key in ("bos_token_id", "eos_token_id", "pad_token_id")
            if config.get(key) is not None
        }


_REGISTRY: dict[str, HFFamily] = {}


def register_family(cls: type[HFFamily]) -> type[HFFamily]:
    """Class decorator: register ``cls`` for each of its ``model_types``.

    Raises:
        ValueError: The class names no ``model_type``, or one already taken by another
            family.
    """
    if not cls.model_types:
        raise ValueError(f"{cls.__name__} names no model_types")
    family = cls()
    for model_type in cls.model_types:
        taken = _REGISTRY.get(model_type)
        if taken is not None and type(taken).__qualname__ != cls.__qualname__:
            raise ValueError(
                f"model_type {model_type!r} is already registered by {type(taken).__name__}"
            )
        _REGISTRY[model_type] = family
    return cls


@functools.cache
def _discover() -> None:
    """Import every module of this package once, so each family file registers itself."""
    import bridge.train.models.families as package

    for info in pkgutil.iter_modules(package.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{package.__name__}.{info.name}")


def supported_model_types() -> tuple[str, ...]:
    """Every registered ``model_type``, sorted."""
    _discover()
    return tuple(sorted(_REGISTRY))


def registered_families() -> list[HFFamily]:
    """One instance of every registered family, in ``model_type`` order."""
    _discover()
    return list(dict.fromkeys(_REGISTRY[model_type] for model_type in sorted(_REGISTRY)))


def family_for(config: dict[str, Any] | str) -> HFFamily:
    """The family of a ``config.json`` dict (or of a ``model_type``).

    Raises:
        ConversionError: No family reads that ``model_type``.
    """
    _discover()
    model_type = config if isinstance(config, str) else config.get("model_type")
    family = _REGISTRY.get(str(model_type))
    if family is None:
        raise ConversionError(
            f"config.json: model_type={model_type!r} is not supported; supported: "
            f"{', '.join(sorted(_REGISTRY))}"
        )
    return family


def provider_kwargs_from_hf_config(config: dict[str, Any]) -> dict[str, Any]:
    """The provider fields that describe the architecture of ``config``.

    Args:
        config: A Hugging Face ``config.json`` as a dict.

    Returns:
        Keyword arguments for the family's provider class (architecture only: no parallel
        layout); megatron's CUDA-only fusions are off, so the provider runs on CPU too.

    Raises:
        ConversionError: Unknown ``model_type`` or a setting the family does not honour.
    """
    family = family_for(config)
    kwargs = family.provider_kwargs(family.text_config(config))
    kwargs.update(_CPU_SAFE)
    return kwargs


def provider_from_hf_config(
    config: dict[str, Any] | str | Any,
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    make_vocab_size_divisible_by: int = 128,
    seq_length: int | None = None,
    **overrides: Any,
) -> Any:
    """The provider (a :class:`~bridge.train.models.GPTModelProvider` or the family's
    subclass) for a Hugging Face model.

    Args:
        config: ``config.json`` as a dict, or the model directory holding it.
        tensor_model_parallel_size: Tensor-parallel size of the provider.
        pipeline_model_parallel_size: Pipeline-parallel size of the provider.
        expert_model_parallel_size: Expert-parallel size (MoE families).
        make_vocab_size_divisible_by: Vocabulary padding granularity per TP rank.
        seq_length: Training sequence length. Default: ``max_position_embeddings`` capped at
            4096 for rotary models; learned positions (GPT-2) always use their table's
            length.
        **overrides: Any other provider field.

    Returns:
        The provider.

    Raises:
        ConversionError: Unsupported architecture, or a parallel layout the model does not
            divide into (the message names the field).
    """
    if not isinstance(config, dict):
        config = read_hf_config(config)
    family = family_for(config)
    text = family.text_config(config)
    kwargs = provider_kwargs_from_hf_config(config)
    if kwargs["position_embedding_type"] in ("rope", "yarn"):
        default = min(int(text.get("max_position_embeddings") or 4096), 4096)
        kwargs["seq_length"] = int(seq_length or default)
    elif seq_length is not None and seq_length != kwargs["seq_length"]:
        raise ConversionError(
            f"seq_length={seq_length}: {family.name} has learned positions for exactly "
            f"{family.positions_field}={kwargs['seq_length']} tokens; train with sequences up "
            "to that length instead"
        )
    kwargs.update(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
    )
    if kwargs["num_layers"] % pipeline_model_parallel_size:
        raise ConversionError(
            f"pipeline_model_parallel_size={pipeline_model_parallel_size} (--pp) does not "
            f"divide the model's {kwargs['num_layers']} layers; choose a pipeline size that does"
        )
    if kwargs.get("num_moe_experts"):
        experts = int(kwargs["num_moe_experts"])
        if experts % expert_model_parallel_size:
            raise ConversionError(
                f"expert_model_parallel_size={expert_model_parallel_size} does not divide the "
                f"model's {experts} experts; choose one that does"
            )
        kwargs["expert_model_parallel_size"] = expert_model_parallel_size
    elif expert_model_parallel_size != 1:
        raise ConversionError(
            f"expert_model_parallel_size={expert_model_parallel_size}: model_type="
            f"{config.get('model_type')!r} has no experts"
        )
    kwargs.update(overrides)
    try:
        return family.provider_class(**kwargs)
    except ValueError as exc:
        raise ConversionError(str(exc).splitlines()[0]) from None


def _effective(provider: Any, name: str) -> Any:
    """A field's value as it affects the model (``None`` where the field does nothing)."""
    value = getattr(provider, name, None)
    rope = getattr(provider, "position_embedding_type", None) in ("rope", "yarn")
    latent = bool(getattr(provider, "multi_latent_attention", False))
    if name == "add_qkv_bias":  # megatron biases Q, K, V with either field
        return bool(value or getattr(provider, "add_bias_linear", False))
    if name == "softmax_scale" and value is None:
        return float(getattr(provider, "kv_channels", 1) or 1) ** -0.5
    if name in ("rotary_base", "rotary_percent", "rope_scaling", "seq_len_interpolation_factor"):
        return value if rope else None
    if name == "rope_scaling_factor":
        return value if rope and getattr(provider, "rope_scaling", False) else None
    if name in ("window_attn_skip_freq", "rotary_base_local"):
        return value if getattr(provider, "window_size", None) is not None else None
    if name.startswith("yarn_"):
        return value if getattr(provider, "position_embedding_type", None) == "yarn" else None
    if name in _MLA_ROPE_FIELDS:
        # Plain RoPE reads only the base; the YaRN fields matter through the softmax
        # scale's mscale(rotary_scaling_factor, mscale_all_dim), which is 1 here.
        read = name == "rope_type" or getattr(provider, "rope_type", None) == "yarn"
        return value if latent and read else None
    if name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        return value if latent else None
    if name.startswith("moe_"):
        return value if getattr(provider, "num_moe_experts", None) else None
    return value


# multi-latent attention's RoPE fields (MLATransformerConfig), compared only with MLA.
_MLA_ROPE_FIELDS = (
    "rope_type",
    "rotary_scaling_factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
)


def architecture_mismatches(provider: Any, reference: Any) -> dict[str, tuple[Any, Any]]:
    """Fields of :data:`ARCHITECTURE_FIELDS` where ``provider`` computes differently from
    ``reference``: ``{field: (provider's value, reference's value)}`` (the class counts as
    ``"class"``; a field that has no effect, such as the RoPE base of a model without RoPE,
    is not compared)."""
    found: dict[str, tuple[Any, Any]] = {}
    if type(provider).__qualname__ != type(reference).__qualname__:
        found["class"] = (type(provider).__name__, type(reference).__name__)
    for name in ARCHITECTURE_FIELDS:
        mine, theirs = _effective(provider, name), _effective(reference, name)
        if not same_setting(mine, theirs):
            found[name] = (getattr(provider, name, None), getattr(reference, name, None))
    return found


def match_family(provider: Any) -> tuple[HFFamily, dict[str, Any]]:
    """The first family whose ``config.json`` for ``provider`` reads back to the same
    architecture, with that config.

    Raises:
        ConversionError: No family does; the message names the provider fields no family
            reproduces (or, when each field is some family's, the closest family's
            differences).
    """
    if getattr(provider, "vocab_size", None) is None:
        raise ConversionError(
            "the checkpoint's model.vocab_size is unset; a Hugging Face config needs it"
        )
    differences: dict[str, dict[str, tuple[Any, Any]]] = {}
    unwritable: dict[str, str] = {}  # families that cannot even write a config for it
    for family in registered_families():
        try:
            config = family.hf_config(provider)
            reference = provider_from_hf_config(
                config,
                seq_length=getattr(provider, "seq_length", None),
                make_vocab_size_divisible_by=provider.make_vocab_size_divisible_by,
            )
        except NotImplementedError:
            continue
        except (ConversionError, KeyError, TypeError, ValueError) as exc:
            unwritable[family.name] = str(exc).splitlines()[0]
            continue
        found = architecture_mismatches(provider, reference)
        if not found:
            return family, config
        differences[family.name] = found
    if not differences:
        name, reason = next(iter(unwritable.items()), ("-", "no family is registered"))
        raise ConversionError(f"no Hugging Face family matches this model ({name}: {reason})")
    common = set.intersection(*(set(found) for found in differences.values())) - {"class"}
    if common:
        fields = ", ".join(
            f"{name}={show_setting(getattr(provider, name, None))}" for name in sorted(common)
        )
        raise ConversionError(
            f"no Hugging Face family has this model's {fields}; give a config.json with "
            "--hf-config if the architecture is one a family reads"
        )
    name, closest = min(differences.items(), key=lambda item: len(item[1]))
    listed = ", ".join(
        f"{field}={show_setting(mine)} ({name}: {show_setting(theirs)})"
        for field, (mine, theirs) in sorted(closest.items())
    )
    raise ConversionError(
        f"no Hugging Face family matches this model; the closest, {name}, differs in {listed}"
    )
