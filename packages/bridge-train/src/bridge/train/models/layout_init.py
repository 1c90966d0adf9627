"""Layout-independent initialisation: the same seed gives the same weights in every layout.

megatron-core seeds each pipeline stage (and expert-parallel rank) differently and draws
every tensor-parallel shard from a stream that depends on the layout, so a PP=2 run starts
from other weights than one process. Here every tensor is drawn from its *global identity*
instead: the key of its ``sharded_state_dict`` entry (layer numbers and expert ids are
global there, as in a checkpoint) and its position in the global tensor.

How a tensor is drawn. The global tensor (the checkpoint's view of it: ``global_shape``,
with the layer and expert axes megatron prepends) is cut into a fixed grid of tiles,
``TILE_ROWS`` x ``TILE_COLS`` over its first two dimensions (whole along the others; a 1-D
tensor in blocks of ``TILE_ROWS * TILE_COLS``). Each tile is filled by the model's own init
method (``init_method``, ``output_layer_init_method`` for ``linear_proj`` / ``linear_fc2``,
``embedding_init_method`` for embeddings) from torch's CPU generator seeded with a hash of
(seed, key, prepended indices, tile index, global shape). A rank draws only the tiles that
overlap its own shard (from the ``ShardedTensor``'s global offsets) and copies the overlap,
so it never holds more than its shards plus one tile of scratch; a tile is the same on every
layout, so the shards of all layouts put together are bit for bit one global tensor. Biases
are zeros and norm weights ones (zeros with ``layernorm_zero_centered_gamma``), as megatron
sets them. Init methods are applied per tile, as megatron applies them per shard on GPU
(``_initialize_affine_weight_gpu``): they must be element-wise distributions (megatron's
normal and scaled-normal are).

Cost: the chunks are built with ``perform_initialization=False`` (megatron's own draw,
which on CPU builds each full weight on every rank, is skipped), then each rank draws the
tiles its shards overlap: about its own share of the parameters, more where a shard is
narrower than a tile (tensor-parallel row shards of small weights), plus one hash per tile.
Measured in ``benchmarks/init_and_reshard.py``; see docs/checkpoints.md.

Covered: the ``provide`` of every provider of this package (GPT dense and MoE, T5, hybrid
Mamba, Gemma 3, MLA / DeepSeek-V3, gpt-oss) and the mimo recipe's modules (each drawn with
its own module's config: :func:`bridge.train.models.mimo.build_mimo_recipe_model`); the
rules below name megatron's init for each kind of parameter, the Mamba mixer's own ones and
torch ``Linear`` layers included. A provider with a ``provide`` of its own is refused by
:func:`check_supported` with the field to change; a parameter no rule knows stops the build
(:class:`LayoutInitError`), never left half-initialised.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.transformer import TransformerConfig

from bridge.config import RNGConfig
from bridge.train.models.gpt_provider import GPTModelProvider

__all__ = [
    "TILE_COLS",
    "TILE_ROWS",
    "LayoutInitError",
    "check_supported",
    "initialize_layout_independent",
    "layout_independent_seed",
    "mamba_init_rule",
    "supports_layout_independent_init",
]

TILE_ROWS = 256
"""Rows of one tile (first dimension of the global tensor)."""

TILE_COLS = 1024
"""Columns of one tile (second dimension of the global tensor)."""

# Modules (by the last component of a parameter's key) that megatron initialises with the
# config's output_layer_init_method (scaled by depth) rather than its init_method (out_proj:
# the Mamba mixer's).
_OUTPUT_PROJECTIONS = frozenset({"linear_proj", "linear_fc2", "out_proj"})
_EMBEDDINGS = frozenset({"word_embeddings", "position_embeddings", "tokentype_embeddings"})
# The Mamba mixer's gated group norm: mamba-ssm's RMSNormGated (megatron's ExtendedRMSNorm)
# and the portable one start at ones whatever layernorm_zero_centered_gamma says.
_GATED_NORMS = frozenset({"GatedGroupRMSNorm", "ExtendedRMSNorm", "RMSNormGated"})


# Where the ``provide`` / ``_build_model`` methods whose modules every rule below knows are
# defined: this package's providers (by module name, so this module imports none of them).
_COVERED_BUILDS = "bridge.train.models."


# The mimo recipe's model section (its modules are built by bridge-mimo in pretrain_mimo).
_MIMO_MODEL = "bridge.train.models.mimo.MimoModelConfig"


class LayoutInitError(ValueError):
    """A model holds a parameter this initialisation does not know how to draw."""


def supports_layout_independent_init(provider: Any) -> bool:
    """Whether ``provider`` builds modules this initialisation covers: the mimo recipe's
    model section, or a :class:`GPTModelProvider` whose ``provide`` and ``_build_model`` are
    this package's (every provider of ``bridge.train.models``, listed in the module
    docstring). A subclass that defines either itself may build modules not known here and
    keeps megatron's seeding unless asked.

    Args:
        provider: A model provider (its ``provide`` builds the model).
    """
    kind = type(provider)
    if f"{kind.__module__}.{kind.__qualname__}" == _MIMO_MODEL:
        return True  # drawn per module by pretrain_mimo (each module's own config)
    if not isinstance(provider, GPTModelProvider):
        return False
    builds = (kind.provide, kind._build_model)
    return all(method.__module__.startswith(_COVERED_BUILDS) for method in builds)


def check_supported(provider: Any, *, field: str = "rng.layout_independent_init") -> None:
    """Refuse a provider this initialisation does not cover.

    Raises:
        LayoutInitError: Naming the provider and ``field``.
    """
    if not supports_layout_independent_init(provider):
        raise LayoutInitError(
            f"{field}=true: layout-independent initialisation covers the providers whose "
            "provide() is this package's (GPT, MoE, T5, hybrid Mamba, Gemma 3, MLA, "
            f"gpt-oss), not {type(provider).__name__}, whose own provide() may build modules "
            f"it does not know; set {field}=false (megatron's per-stage seeding) or leave it "
            "unset (null: used where supported)"
        )


def layout_independent_seed(rng_config: RNGConfig, provider: Any) -> int | None:
    """The seed to draw weights with, or ``None`` for megatron's per-stage seeding.

    Resolves ``rng.layout_independent_init``: ``true`` requires a covered provider (see
    :func:`check_supported`), ``null`` uses it where covered and megatron's seeding
    elsewhere (and with ``data_parallel_random_init``), ``false`` never.

    Args:
        rng_config: The ``rng`` section (``seed``, ``layout_independent_init``,
            ``data_parallel_random_init``).
        provider: The model provider.

    Raises:
        LayoutInitError: ``true`` for a provider that is not covered.
    """
    wanted = getattr(rng_config, "layout_independent_init", None)
    if wanted is None:
        dp_random = getattr(rng_config, "data_parallel_random_init", False)
        wanted = not dp_random and supports_layout_independent_init(provider)
    if wanted is False:
        return None
    check_supported(provider)
    return int(rng_config.seed)


def _tile_seed(seed: int, key: str, coordinates: Sequence[int], shape: Sequence[int]) -> int:
    text = f"{seed}|{key}|{tuple(coordinates)}|{tuple(shape)}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def _blocks(size: int, block: int, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
    """``(tile index, tile start, tile stop)`` of the tiles of ``range(size)`` overlapping
    ``[start, stop)``."""
    for index in range(start // block, (stop - 1) // block + 1):
        yield index, index * block, min(size, (index + 1) * block)


def _fill_random(
    target: torch.Tensor,
    key: str,
    global_shape: Sequence[int],
    global_offset: Sequence[int],
    prepend: int,
    seed: int,
    init_method: Callable[[torch.Tensor], Any],
) -> None:
    """Fill ``target`` (the local shard) with its slice of the tiled global tensor."""
    body_shape = tuple(global_shape[prepend:])
    body_offset = tuple(global_offset[prepend:])
    body_local = tuple(target.shape)  # the prepended axes (layer, expert) are not in the shard
    if not body_shape:
        raise LayoutInitError(f"{key}: a scalar parameter has no tiles")
    # The tiled dimensions' tile sizes (rows and columns; blocks of a 1-D tensor), and the
    # tiles of each that overlap the shard; the other dimensions are whole in a tile.
    sizes = (TILE_ROWS, TILE_COLS) if len(body_shape) >= 2 else (TILE_ROWS * TILE_COLS,)
    tiled = len(sizes)
    per_dim = [
        list(_blocks(body_shape[d], size, body_offset[d], body_offset[d] + body_local[d]))
        for d, size in enumerate(sizes)
    ]
    rest = [slice(o, o + n) for o, n in zip(body_offset[tiled:], body_local[tiled:], strict=True)]
    outer = tuple(global_offset[:prepend])  # the shard's one index on each prepended axis
    for tiles in itertools.product(*per_dim):
        tile_shape = [t1 - t0 for _, t0, t1 in tiles] + list(body_shape[tiled:])
        tile = torch.empty(tile_shape, dtype=torch.float32)
        indices = [index for index, _, _ in tiles] + [0] * (2 - tiled)  # 1-D: column 0
        generator_seed = _tile_seed(seed, key, (*outer, *indices), global_shape)
        torch.default_generator.manual_seed(generator_seed)
        init_method(tile)
        # The overlap of this tile with the shard, in tile and in local coordinates.
        source: list[slice] = []
        dest: list[slice] = []
        for (_, t0, t1), start, count in zip(tiles, body_offset, body_local, strict=False):
            lo, hi = max(t0, start), min(t1, start + count)
            source.append(slice(lo - t0, hi - t0))
            dest.append(slice(lo - start, hi - start))
        target[tuple(dest)].copy_(tile[(*source, *rest)])


def _parameter_owners(
    chunk: torch.nn.Module, config: TransformerConfig | None
) -> dict[int, tuple[str, torch.nn.Module, str, Any]]:
    """``{storage address: (qualified name, owning module, attribute, config)}`` of every
    parameter; ``config`` is the nearest enclosing module's (a MIMO model's modules each
    have their own), else the one given."""
    owners: dict[int, tuple[str, torch.nn.Module, str, Any]] = {}
    configs: dict[str, Any] = {}
    for module_name, module in chunk.named_modules():  # parents before their children
        parent = module_name.rpartition(".")[0]
        own = getattr(module, "config", None)
        configs[module_name] = own if own is not None else configs.get(parent, config)
        for attribute, param in module.named_parameters(recurse=False):
            address = param.untyped_storage().data_ptr()
            name = f"{module_name}.{attribute}" if module_name else attribute
            owners.setdefault(address, (name, module, attribute, configs[module_name]))
    return owners


def _mixer_setting(module: torch.nn.Module, name: str) -> Any:
    """A Mamba mixer's init setting: its attribute, else its constructor's default (megatron's
    ``MambaLayer`` passes none of ``dt_min``, ``dt_max``, ``dt_init_floor``,
    ``A_init_range``, so the defaults are what megatron draws with)."""
    if hasattr(module, name):
        return getattr(module, name)
    parameter = inspect.signature(type(module).__init__).parameters.get(name)
    if parameter is None or parameter.default is inspect.Parameter.empty:
        raise LayoutInitError(
            f"{type(module).__name__} has no init setting {name!r}; set "
            "rng.layout_independent_init=false"
        )
    return parameter.default


def mamba_init_rule(
    module: torch.nn.Module, attribute: str
) -> Callable[[torch.Tensor], Any] | float:
    """megatron's ``MambaMixer`` init of its own (non-linear) parameters, element by element
    (the portable mixer draws its full tensors with it too).

    ``conv1d_weight``: ``kaiming_uniform_(a=sqrt(5))`` (fan-in ``d_conv``: the tile keeps
    the last two axes whole, so the bound is the full tensor's) or ``uniform(+-conv_init)``;
    ``conv1d_bias``: ``uniform(+-1/sqrt(d_conv))``; ``dt_bias``: the inverse softplus of
    ``dt = exp(U[0,1) * (ln dt_max - ln dt_min) + ln dt_min)`` clamped at ``dt_init_floor``;
    ``A_log``: ``ln U[A_init_range)``; ``D``: ones.
    """
    if attribute == "D":
        return 1.0
    if attribute == "conv1d_weight":
        conv_init = _mixer_setting(module, "conv_init")
        if conv_init is None:
            return lambda tile: torch.nn.init.kaiming_uniform_(tile, a=math.sqrt(5))
        return lambda tile: torch.nn.init.uniform_(tile, -conv_init, conv_init)
    if attribute == "conv1d_bias":
        bound = 1 / math.sqrt(_mixer_setting(module, "d_conv"))
        return lambda tile: torch.nn.init.uniform_(tile, -bound, bound)
    if attribute == "dt_bias":
        low = math.log(_mixer_setting(module, "dt_min"))
        high = math.log(_mixer_setting(module, "dt_max"))
        floor = _mixer_setting(module, "dt_init_floor")

        def dt_bias(tile: torch.Tensor) -> None:
            dt = torch.exp(tile.uniform_() * (high - low) + low).clamp(min=floor)
            tile.copy_(dt + torch.log(-torch.expm1(-dt)))  # the inverse of softplus

        return dt_bias
    if attribute == "A_log":
        a_low, a_high = _mixer_setting(module, "A_init_range")
        return lambda tile: tile.uniform_(a_low, a_high).log_()
    raise LayoutInitError(
        f"layout-independent initialisation does not know parameter {attribute!r} of "
        f"{type(module).__name__}; set rng.layout_independent_init=false"
    )


_MAMBA_PARAMETERS = frozenset({"conv1d_weight", "conv1d_bias", "dt_bias", "A_log", "D"})


def _init_rule(
    key: str, module: torch.nn.Module, attribute: str, config: TransformerConfig
) -> Callable[[torch.Tensor], Any] | float:
    """The init method megatron applies to this parameter, or the constant it sets."""
    if type(module) is torch.nn.Linear:
        # torch's own init (kaiming_uniform_(a=sqrt(5)) and its bias rule): both are
        # uniform(+-1/sqrt(in_features)) (the MIMO patch embedding and projection).
        bound = 1 / math.sqrt(module.in_features)
        return lambda tile: torch.nn.init.uniform_(tile, -bound, bound)
    parts = key.split(".")
    owner = parts[-2] if len(parts) >= 2 else ""
    gamma = 0.0 if getattr(config, "layernorm_zero_centered_gamma", False) else 1.0
    if attribute == "layer_norm_weight":  # Transformer Engine's fused norm + linear
        return gamma
    if attribute == "layer_norm_bias":
        return 0.0
    if type(module).__name__ in _GATED_NORMS:
        return 1.0
    if "norm" in type(module).__name__.lower():
        return gamma if attribute == "weight" else 0.0
    if attribute in _MAMBA_PARAMETERS:
        return mamba_init_rule(module, attribute)
    if owner == "router" or attribute in ("position_embedding", "softmax_offset"):
        # Drawn with init_method: megatron's TopKRouter its weight (and bias), bridge-mimo's
        # PatchEncoder its learned table (normal(0, init_method_std)), megatron's
        # DotProductAttention the learnable attention sinks (gpt-oss).
        return config.init_method
    if attribute == "bias":
        return 0.0
    if attribute != "weight":
        raise LayoutInitError(
            f"{key}: layout-independent initialisation does not know parameter "
            f"{attribute!r} of {type(module).__name__}; set rng.layout_independent_init=false"
        )
    if owner in _EMBEDDINGS:
        return config.embedding_init_method
    if owner in _OUTPUT_PROJECTIONS:
        return config.output_layer_init_method
    if owner == "output_layer" and getattr(config, "use_mup", False):
        return config.embedding_init_method
    return config.init_method


def _sharded_tensors(chunk: torch.nn.Module) -> Iterator[Any]:

    sharded_state_dict: Any = chunk.sharded_state_dict  # a megatron module's method
    for entry in nested_values(sharded_state_dict()):
        if isinstance(entry, ShardedTensorFactory):
            built = entry.build()
            entries = nested_values(built) if isinstance(built, (dict, list)) else [built]
            yield from (e for e in entries if isinstance(e, ShardedTensor))
        elif isinstance(entry, ShardedTensor):
            yield entry


@torch.no_grad()
def initialize_layout_independent(
    chunks: Sequence[torch.nn.Module], config: TransformerConfig | None, seed: int
) -> None:
    """Draw every parameter of ``chunks`` from its global identity (see the module docstring).

    Args:
        chunks: This rank's model chunks (one per virtual pipeline stage), built under the
            current parallel state, not yet wrapped.
        config: The model's ``TransformerConfig`` (its init methods and norm settings),
            used for the parameters of modules without a ``config`` of their own or of an
            enclosing module's (megatron modules carry theirs, and it wins: a MIMO model's
            modules each have one); ``None`` where every module has one.
        seed: The run's seed (``rng.seed``).

    Raises:
        LayoutInitError: A parameter is not in the sharded state dict or its init is unknown
            (nothing is left half-drawn silently: the run stops).
    """
    # Draws use torch's CPU generator, reseeded per tile; the caller's stream is restored.
    with torch.random.fork_rng(devices=[]):
        for chunk in chunks:
            owners = _parameter_owners(chunk, config)
            done: set[int] = set()
            for sharded in _sharded_tensors(chunk):
                data = sharded.data
                if data is None or not data.is_floating_point() or "_extra_state" in sharded.key:
                    continue
                address = data.untyped_storage().data_ptr()
                if address not in owners:
                    continue  # a buffer (e.g. MoE token counts): megatron's value stands
                if sharded.flattened_range is not None:
                    raise LayoutInitError(f"{sharded.key}: flattened shards are not drawn here")
                _, module, attribute, module_config = owners[address]
                rule = _init_rule(sharded.key, module, attribute, module_config)
                if isinstance(rule, float):
                    data.fill_(rule)
                else:
                    _fill_random(
                        data,
                        sharded.key,
                        sharded.global_shape,
                        sharded.global_offset,
                        sharded.prepend_axis_num,
                        seed,
                        rule,
                    )
                done.add(address)
            missing = [name for address, (name, *_) in owners.items() if address not in done]
            if missing:
                raise LayoutInitError(
                    f"parameters {missing[:5]} are not in the model's sharded state dict, so "
                    "layout-independent initialisation cannot place them; set "
                    "rng.layout_independent_init=false"
                )
