"""Build a megatron-core ``MimoModel`` on the process groups of a MIMO infra.

:func:`build_mimo_model` injects each module's ``ProcessGroupCollection`` into the module
specs, hands the grids to ``MimoModel`` (which then builds on each rank only the modules
that rank runs) and can seed every leaf module's initialisation on its own, so parameters
do not depend on which modules a rank builds or in which order.
"""

from __future__ import annotations

import copy
import inspect
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from megatron.core.models.mimo import MimoModel, MimoModelConfig
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from bridge.mimo.infra import MegatronMIMOInfra

__all__ = ["build_mimo_model", "module_init_seed"]


def module_init_seed(init_seed: int, path: str) -> int:
    """The seed a leaf module at ``path`` (e.g. ``"vision/encoders/patch"``) is built with."""
    return (init_seed + zlib.crc32(path.encode())) % (2**31 - 1)


def _seeded_class(cls: type, seed: int) -> type:
    """A subclass of ``cls`` whose constructor runs under a fixed CPU RNG seed."""

    class Seeded(cls):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            with torch.random.fork_rng(devices=[]):
                # CPU generator only: megatron's use_cpu_initialization draws from it.
                torch.default_generator.manual_seed(seed)
                super().__init__(*args, **kwargs)

    Seeded.__name__ = cls.__name__
    Seeded.__qualname__ = cls.__qualname__
    Seeded.__module__ = cls.__module__
    Seeded.__doc__ = cls.__doc__
    return Seeded


def _accepts(cls: Any, name: str) -> bool:
    if not isinstance(cls, type):
        return False
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _leaf_specs(spec: ModuleSpec) -> Iterator[tuple[str, ModuleSpec]]:
    """(path, spec) of every buildable leaf inside a modality submodule spec."""
    submodules = spec.submodules or {}
    if not isinstance(submodules, Mapping):
        return
    for group in ("encoders", "decoders"):
        for key, leaf in (submodules.get(group) or {}).items():
            if isinstance(leaf, ModuleSpec):
                yield f"{group}/{key}", leaf
    for group in ("input_projections", "output_projections"):
        for index, leaf in enumerate(submodules.get(group) or []):
            if isinstance(leaf, ModuleSpec):
                yield f"{group}/{index}", leaf


def _check_tp(module: str, where: str, params: Mapping[str, Any], tp: int) -> None:
    for key, value in params.items():
        if isinstance(value, TransformerConfig) and value.tensor_model_parallel_size != tp:
            raise ValueError(
                f"module {module!r}: {where} param {key!r} has tensor_model_parallel_size="
                f"{value.tensor_model_parallel_size} but the layout gives the module tp={tp}; "
                f"make them equal"
            )


def _prepare_leaf(
    module: str,
    path: str,
    spec: ModuleSpec,
    pgs: ProcessGroupCollection | None,
    tp: int,
    init_seed: int | None,
) -> None:
    spec.params = dict(spec.params or {})
    _check_tp(module, path, spec.params, tp)
    if pgs is not None:
        if _accepts(spec.module, "pg_collection") and spec.params.get("pg_collection") is None:
            spec.params["pg_collection"] = pgs
        elif _accepts(spec.module, "tp_group") and spec.params.get("tp_group") is None:
            spec.params["tp_group"] = pgs.tp
    if init_seed is not None and isinstance(spec.module, type):
        spec.module = _seeded_class(spec.module, module_init_seed(init_seed, f"{module}/{path}"))


def build_mimo_model(
    infra: MegatronMIMOInfra,
    *,
    language_model_spec: ModuleSpec,
    modality_submodules_spec: Mapping[str, ModuleSpec],
    special_token_ids: Mapping[str, int],
    init_seed: int | None = None,
    kv_format: str = "sbhd",
) -> MimoModel:
    """Build the ``MimoModel`` of ``infra``'s layout on this rank.

    Each leaf module (the language model, every encoder, decoder and projection of every
    modality) whose constructor accepts ``pg_collection`` gets its module's
    ``ProcessGroupCollection`` (or ``tp_group`` when it accepts only that), unless the spec
    already sets it. In a non-colocated layout the grids go to ``MimoModel``, which builds
    only the modules this rank runs.

    Args:
        infra: The job's infra.
        language_model_spec: Spec of the language model (e.g. ``ModuleSpec(GPTModel,
            params={...})``); its ``config`` must have the layout's tensor-parallel size.
        modality_submodules_spec: Encoder module name -> ``ModalitySubmodules`` spec; the
            names must be exactly the layout's encoder modules.
        special_token_ids: Encoder module name -> the token id that marks, in the input ids,
            the positions the encoder's embeddings fill.
        init_seed: When set, every leaf module is constructed under its own CPU RNG seed
            (:func:`module_init_seed`), so with ``use_cpu_initialization=True`` parameters are
            the same whatever the layout (a single-process run builds the same weights).
        kv_format: Passed to ``MimoModelConfig``.

    Returns:
        The model (on CPU; move it to the device yourself).

    Raises:
        ValueError: Module names or special tokens do not match the layout, or a config's
            tensor-parallel size differs from the layout.
    """
    language = infra.language_module_name
    encoders = set(infra.encoder_module_names)
    given = set(modality_submodules_spec)
    if given != encoders:
        raise ValueError(
            f"modality_submodules_spec names {sorted(given)} must equal the layout's encoder "
            f"modules {sorted(encoders)} (missing: {sorted(encoders - given)}, extra: "
            f"{sorted(given - encoders)})"
        )
    missing_tokens = sorted(encoders - set(special_token_ids))
    if missing_tokens:
        raise ValueError(
            f"special_token_ids has no token for encoder module(s) {missing_tokens}; give each "
            f"encoder the token id that marks its positions in the input ids"
        )

    lm_spec = copy.deepcopy(language_model_spec)
    _prepare_leaf(
        language,
        "model",
        lm_spec,
        infra.pg_collections.get(language),
        infra.tp_size(language),
        init_seed,
    )
    modality_specs: dict[str, ModuleSpec] = {}
    for name in infra.encoder_module_names:
        spec = copy.deepcopy(modality_submodules_spec[name])
        for path, leaf in _leaf_specs(spec):
            _prepare_leaf(
                name, path, leaf, infra.pg_collections.get(name), infra.tp_size(name), init_seed
            )
        modality_specs[name] = spec

    config = MimoModelConfig(
        language_model_spec=lm_spec,
        modality_submodules_spec=modality_specs,
        special_token_ids=dict(special_token_ids),
        # Colocated modules share every rank: megatron's grid-based colocated path would
        # build nccl communicators, and equal layouts need no communication at all.
        module_to_grid_map=None if infra.is_colocated else dict(infra.module_to_grid_map),
        kv_format=kv_format,
    )
    model = MimoModel(config)
    _bind_module_groups(model, infra)
    return model


def _bind_module_groups(model: MimoModel, infra: MegatronMIMOInfra) -> None:
    """Give every part of each module this rank runs its own grid's groups.

    megatron-core's ``sharded_state_dict`` falls back to megatron's *global* parallel state
    for a module without a ``tp_group`` (or a modality submodule without a
    ``pg_collection``), which a MIMO job never initialises: each module has its own grid.
    Checkpoints therefore need every such module bound to its grid's tensor-parallel and
    data-parallel groups, so TP shards get their offsets and DP replicas their replica ids.
    """
    modules: dict[str, torch.nn.Module] = {}
    language = getattr(model, "language_model", None)
    if language is not None:
        modules[infra.language_module_name] = language
    for name, submodule in getattr(model, "modality_submodules", {}).items():
        modules[name] = submodule
    for name, module in modules.items():
        pgs = infra.pg_collections.get(name)
        if pgs is None:
            continue
        for part in module.modules():
            if hasattr(part, "pg_collection") and part.pg_collection is None:
                part.pg_collection = pgs
            takes_group = isinstance(part, MegatronModule) or hasattr(part, "tp_group")
            if takes_group and getattr(part, "tp_group", None) is None:
                part.tp_group = pgs.tp
