"""Multi-module process-group and gradient utilities for heterogeneous MIMO training.

The functions follow Megatron-Bridge's ``training.megatron_mimo_parallel_utils``: they find
the modules a rank runs, build the ``pg_collection`` a schedule expects, switch gradient
synchronisation off during micro-batch accumulation, finalize each module's gradients over
its own data-parallel group (rescaling encoder gradients when encoder and language-model
data-parallel sizes differ), reset gradient buffers, and validate a layout and the data
contract before training starts.

Gradients of a module are reduced by the module's wrapper when it has one (megatron-core
``DistributedDataParallel``: ``finish_grad_sync``; torch ``DistributedDataParallel``: during
backward) and by an all-reduce over the module's data-parallel group otherwise (plain
modules, the CPU path).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from megatron.core.hyper_comm_grid import HyperCommGrid
from megatron.core.models.mimo import MimoModel
from megatron.core.process_groups_config import ProcessGroupCollection
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from bridge.mimo.infra import MegatronMIMOInfra

__all__ = [
    "build_pg_collection_for_schedule",
    "finalize_model_grads_multimodule",
    "get_active_module_pg",
    "get_module_to_grid_tuple",
    "is_current_rank_in_grid",
    "multimodule_no_sync",
    "unwrap_megatron_mimo_model",
    "validate_data_loader_contract",
    "validate_no_stub_ranks",
    "zero_grad_buffer_for_multimodule",
]

logger = logging.getLogger(__name__)


class _InfraFields(Protocol):
    """What these helpers read of an infra object: the reference's fields.

    :class:`MegatronMIMOInfra` has them, and so has Megatron-Bridge's own
    ``MegatronMIMOInfra`` (``module_to_grid_map``, ``topology``, ``pg_collections``,
    ``participating_modules``, ``module_output_ndim``), so code ported from it can pass its
    infra unchanged. ``language_module_name`` is optional (see :func:`_language_module`).
    """

    module_to_grid_map: dict[str, HyperCommGrid]
    pg_collections: dict[str, ProcessGroupCollection | None]


def _language_module(infra: _InfraFields) -> str:
    """The language module's name: the infra's own, else megatron-core's MIMO key."""
    name = getattr(infra, "language_module_name", None)
    if name:
        return str(name)
    from megatron.core.models.mimo.config.role import MIMO_LANGUAGE_MODULE_KEY

    if MIMO_LANGUAGE_MODULE_KEY not in infra.module_to_grid_map:
        raise ValueError(
            f"the infra names no language module and has no {MIMO_LANGUAGE_MODULE_KEY!r} "
            f"module (megatron-core's MIMO_LANGUAGE_MODULE_KEY); modules: "
            f"{list(infra.module_to_grid_map)}; set infra.language_module_name"
        )
    return MIMO_LANGUAGE_MODULE_KEY


def _get_dp_size_from_grid(grid: HyperCommGrid) -> int:
    """Get the DP dimension size from a grid's shape metadata.

    Uses ``grid.shape`` / ``grid.dim_names`` rather than process groups, so it works on every
    rank, including ranks outside the grid.

    Raises:
        ValueError: The grid has no ``"dp"`` dimension.
    """
    if "dp" not in grid.dim_names:
        raise ValueError(f"grid has no 'dp' dimension (dim_names={grid.dim_names})")
    return int(grid.shape[grid.dim_names.index("dp")])


def _wrapper_types() -> tuple[type, ...]:
    from megatron.core.distributed import DistributedDataParallel as MegatronDDP
    from megatron.core.transformer.module import Float16Module

    return (Float16Module, MegatronDDP, torch.nn.parallel.DistributedDataParallel)


def unwrap_megatron_mimo_model(
    model: torch.nn.Module | Sequence[torch.nn.Module],
) -> MimoModel:
    """Unwrap Float16Module/DDP wrappers to get the underlying MimoModel.

    Args:
        model: A MimoModel or a wrapped version (Float16Module, megatron-core or torch
            DistributedDataParallel, nested in any order). A one-element list (a schedule's
            model chunks) is accepted too.

    Returns:
        The underlying MimoModel instance.

    Raises:
        RuntimeError: If the model cannot be unwrapped to a MimoModel.
    """
    current: Any = model
    if isinstance(current, list | tuple) and len(current) == 1:
        current = current[0]
    wrappers = _wrapper_types()
    seen = [type(current).__name__]
    while isinstance(current, wrappers):
        wrapper: Any = current
        current = wrapper.module
        seen.append(type(current).__name__)
    if isinstance(current, MimoModel):
        return current
    raise RuntimeError(
        f"cannot unwrap {' -> '.join(seen)} to a MimoModel; expected a MimoModel, optionally "
        f"wrapped in Float16Module / megatron-core DistributedDataParallel / torch "
        f"DistributedDataParallel"
    )


def is_current_rank_in_grid(grid: HyperCommGrid) -> bool:
    """Check if current rank participates in the given grid.

    Args:
        grid: HyperCommGrid to check participation in.

    Returns:
        True if current rank is within the grid's rank range.
    """
    rank = dist.get_rank()
    return bool(grid.rank_offset <= rank < grid.rank_offset + grid.size)


def get_active_module_pg(
    megatron_mimo_infra: MegatronMIMOInfra | _InfraFields | _InfraFields,
) -> tuple[str, ProcessGroupCollection]:
    """Return the (module_name, pg_collection) for the single active module on this rank.

    Non-colocated MIMO assigns each rank to exactly one module; this returns that module's
    name and ProcessGroupCollection.

    Raises:
        AssertionError: If more or fewer than one module is active on this rank.
    """
    active = [
        (name, pgs) for name, pgs in megatron_mimo_infra.pg_collections.items() if pgs is not None
    ]
    assert len(active) == 1, (
        f"rank {dist.get_rank()} runs {len(active)} modules {[n for n, _ in active]}; "
        f"get_active_module_pg needs exactly one (a non-colocated layout)"
    )
    return active[0]


def _module_of(model: MimoModel, name: str, language: str) -> torch.nn.Module | None:
    if name == language:
        return model.language_model
    if name in model.modality_submodules:
        return model.modality_submodules[name]
    return None


def get_module_to_grid_tuple(
    megatron_mimo_model: Any, infra: MegatronMIMOInfra | _InfraFields
) -> list[tuple[torch.nn.Module, HyperCommGrid]]:
    """Build list of (module, grid) tuples for all modules the current rank participates in.

    Args:
        megatron_mimo_model: The MimoModel instance (wrappers are unwrapped).
        infra: MegatronMIMOInfra | _InfraFields containing module_to_grid_map.

    Returns:
        List of (module, grid) tuples for modules this rank participates in, in the infra's
        module order. A module stays wrapped the way the model holds it (e.g. in DDP).

    Raises:
        RuntimeError: The model holds no built module for a module this rank runs.
    """
    model = unwrap_megatron_mimo_model(megatron_mimo_model)
    pairs = []
    for name, grid in infra.module_to_grid_map.items():
        if not is_current_rank_in_grid(grid):
            continue
        module = _module_of(model, name, _language_module(infra))
        if module is None:
            raise RuntimeError(
                f"rank {dist.get_rank()} runs module {name!r} but the MimoModel built no "
                f"{name!r} module on it; build the model with build_mimo_model(infra, ...)"
            )
        pairs.append((module, grid))
    return pairs


def build_pg_collection_for_schedule(infra: MegatronMIMOInfra | _InfraFields) -> Any:
    """Build pg_collection compatible with schedule.

    Primary: a ``MultiModuleProcessGroupCollection`` of the modules this rank runs, whose
    language-model entry is ``None`` on encoder-only ranks (megatron-core >= 0.16 accepts
    that). Fallback, for a megatron-core without the class: the list of this rank's
    ProcessGroupCollections. Uses ``infra.pg_collections`` directly; groups are never
    rebuilt.

    Args:
        infra: MegatronMIMOInfra | _InfraFields with pg_collections for each module.

    Returns:
        MultiModuleProcessGroupCollection or list of ProcessGroupCollections.
    """
    module_pgs = {name: pgs for name, pgs in infra.pg_collections.items() if pgs is not None}
    try:
        from megatron.core.process_groups_config import MultiModuleProcessGroupCollection
    except ImportError:  # pragma: no cover - megatron-core < 0.16
        return list(module_pgs.values())
    language = _language_module(infra)
    return MultiModuleProcessGroupCollection(
        module_pgs=module_pgs,
        language_model_module_name=language if language in module_pgs else None,
    )


@contextlib.contextmanager
def multimodule_no_sync(
    *, module_to_grid_tuple: Sequence[tuple[torch.nn.Module, HyperCommGrid]]
) -> Iterator[None]:
    """Context manager to disable gradient sync for all modules during accumulation.

    Meant to be bound with ``functools.partial(multimodule_no_sync, module_to_grid_tuple=...)``
    because a schedule calls ``no_sync_func()`` with no arguments. Enters ``no_sync()`` of
    every module that has one (megatron-core / torch DDP); a plain module never syncs during
    backward (its gradients are reduced by :func:`finalize_model_grads_multimodule`), so it
    needs nothing.

    Args:
        module_to_grid_tuple: List of (module, grid) tuples (keyword-only, bound via partial).

    Yields:
        None.
    """
    with contextlib.ExitStack() as stack:
        for module, _grid in module_to_grid_tuple:
            no_sync = getattr(module, "no_sync", None)
            if callable(no_sync):
                stack.enter_context(no_sync())
        yield


def _grad_tensors(module: torch.nn.Module, *, materialize: bool) -> list[torch.Tensor]:
    """The gradient tensors the optimizer will read (``main_grad`` under megatron DDP).

    With ``materialize``, a trainable parameter without a gradient (unused in this rank's
    micro-batches) gets a zero one, so every replica reduces the same list of tensors.
    """
    grads = []
    for param in module.parameters():
        if not param.requires_grad:
            continue
        grad = getattr(param, "main_grad", None)
        if grad is None:
            if param.grad is None and materialize:
                param.grad = torch.zeros_like(param)
            grad = param.grad
        if grad is not None:
            grads.append(grad)
    return grads


def _all_reduce_sum(grads: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    if not grads or dist.get_world_size(group) == 1:
        return
    # One flat buffer per dtype: one collective instead of one per parameter.
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for bucket in by_dtype.values():
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        for grad, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
            grad.copy_(synced)


def _name_of_grid(infra: MegatronMIMOInfra | _InfraFields, grid: HyperCommGrid) -> str:
    for name, candidate in infra.module_to_grid_map.items():
        if candidate is grid:
            return name
    raise ValueError("module_to_grid_tuple holds a grid that is not in infra.module_to_grid_map")


def _global_num_tokens(
    infra: MegatronMIMOInfra | _InfraFields, num_tokens: torch.Tensor | int
) -> float:
    """Sum of the language model's loss tokens over the whole job (collective on the world)."""
    language = _language_module(infra)
    counts = False
    language_pgs = infra.pg_collections.get(language)
    if language_pgs is not None:
        # Every tensor-parallel rank of a replica saw the same tokens: count one of them.
        counts = dist.get_rank(group=language_pgs.tp) == 0
    local = torch.as_tensor(num_tokens, dtype=torch.float64).detach().cpu().reshape(())
    contribution = local if counts else torch.zeros((), dtype=torch.float64)
    if dist.get_backend() == "nccl":
        contribution = contribution.cuda()
    dist.all_reduce(contribution)
    total = float(contribution)
    if total <= 0:
        raise ValueError(
            f"the global batch has {total:g} loss tokens; per-token loss normalisation needs "
            f"at least one (check the loss mask)"
        )
    return total


@torch.no_grad()
def finalize_model_grads_multimodule(
    model: list[torch.nn.Module],
    num_tokens: torch.Tensor | int | None = None,
    pg_collection: Any = None,
    force_all_reduce: bool | None = None,
    *,
    infra: MegatronMIMOInfra | _InfraFields,
    module_to_grid_tuple: Sequence[tuple[torch.nn.Module, HyperCommGrid]],
) -> None:
    """Finalize gradients for each module using infra.pg_collections.

    Signature matches a schedule's call pattern
    ``config.finalize_model_grads_func([model], num_tokens, pg_collection,
    force_all_reduce=flag)``; ``infra`` and ``module_to_grid_tuple`` are pre-bound with
    ``functools.partial``. The schedule-provided ``pg_collection`` and ``force_all_reduce``
    are ignored: each module reduces over its own data-parallel group.

    Two normalisations, chosen by ``num_tokens``:

    * ``num_tokens is None`` (each language replica's loss is the mean over its own tokens,
      divided by the number of micro-batches): every module's gradient is averaged over its
      data-parallel group. An encoder replica, however, carries the gradient of
      ``encoder_dp / llm_dp`` times too few (fan-in) or too many (fan-out) language
      replicas' samples relative to the language model's averaging, so encoder gradients
      are multiplied by ``encoder_dp / llm_dp``. The result equals the gradient of the mean
      loss of the global batch on one process (when every sample has as many loss tokens).
    * ``num_tokens`` given (the loss is the *sum* over loss tokens): ``num_tokens`` is this
      rank's loss-token count (0 on encoder-only ranks; it must then be given on every rank,
      since the total is summed over the world); every module's gradient is summed over its
      data-parallel group and divided by the job's total loss-token count. Exact for any
      loss mask.

    Args:
        model: Model list (passed by schedule, ignored - we use module_to_grid_tuple).
        num_tokens: This rank's loss-token count for per-token normalisation, or None.
        pg_collection: Schedule-provided PG (ignored - we use per-module PGs).
        force_all_reduce: Schedule-provided flag (ignored - per-module PGs control sync).
        infra: MegatronMIMOInfra | _InfraFields with per-module pg_collections (keyword-only, bound via
            partial).
        module_to_grid_tuple: List of (module, grid) tuples (keyword-only, bound via
            partial).

    A rank given no modules has nothing to finalize and returns at once, taking part in no
    collective (with per-token normalisation every rank holds a module, as
    :func:`validate_no_stub_ranks` ensures).

    Raises:
        ValueError: A grid is not in the infra, or per-token normalisation finds no token.
    """
    del model, pg_collection, force_all_reduce  # per-module groups decide (see docstring)
    if not module_to_grid_tuple:
        return  # no module on this rank: nothing to finalize (reference 003)
    per_token = num_tokens is not None
    total_tokens = _global_num_tokens(infra, num_tokens) if num_tokens is not None else 1.0
    language = _language_module(infra)
    llm_dp = _get_dp_size_from_grid(infra.module_to_grid_map[language])

    for module, grid in module_to_grid_tuple:
        name = _name_of_grid(infra, grid)
        pgs = infra.pg_collections[name]
        if pgs is None:
            raise ValueError(f"this rank does not run module {name!r} but was asked to finalize it")
        dp = _get_dp_size_from_grid(grid)
        finish = getattr(module, "finish_grad_sync", None)
        is_torch_ddp = isinstance(module, torch.nn.parallel.DistributedDataParallel)
        grads = _grad_tensors(module, materialize=not callable(finish) and not is_torch_ddp)

        if callable(finish):
            # megatron-core DDP: averages (or sums, with calculate_per_token_loss) into
            # main_grad over the data-parallel group it was built with.
            finish()
            ddp_config = getattr(module, "ddp_config", None)
            summed = bool(getattr(ddp_config, "calculate_per_token_loss", False))
        elif is_torch_ddp:
            summed = False  # torch DDP averaged during backward
        else:
            _all_reduce_sum(grads, pgs.dp)
            summed = True

        if per_token:
            scale = (1.0 if summed else float(dp)) / total_tokens
        else:
            scale = 1.0 / dp if summed else 1.0
            if name != language:
                scale *= dp / llm_dp
        if scale != 1.0:
            for grad in grads:
                grad.mul_(scale)


def zero_grad_buffer_for_multimodule(
    module_to_grid_tuple: Sequence[tuple[torch.nn.Module, HyperCommGrid]],
) -> None:
    """Reset gradient buffers for all modules of this rank.

    Calls ``zero_grad_buffer()`` of DDP-wrapped modules (megatron-core) and drops ``.grad``
    of the parameters of any other module.

    Args:
        module_to_grid_tuple: List of (module, grid) tuples.
    """
    for module, _grid in module_to_grid_tuple:
        zero = getattr(module, "zero_grad_buffer", None)
        if callable(zero):
            zero()
        else:
            module.zero_grad(set_to_none=True)


def validate_no_stub_ranks(module_to_grid_map: dict[str, HyperCommGrid], world_size: int) -> None:
    """Ensure every rank participates in at least one module.

    Stub ranks (ranks not participating in any module) are NOT supported. This runs at setup
    time to fail fast with a clear error.

    Args:
        module_to_grid_map: Mapping of module names to their HyperCommGrids.
        world_size: Total number of ranks in the world.

    Raises:
        ValueError: If any rank doesn't participate in a module.
    """
    covered: set[int] = set()
    for grid in module_to_grid_map.values():
        covered.update(range(grid.rank_offset, grid.rank_offset + grid.size))
    stubs = [rank for rank in range(world_size) if rank not in covered]
    if stubs:
        spans = ", ".join(
            f"{name!r}: ranks {g.rank_offset}-{g.rank_offset + g.size - 1}"
            for name, g in module_to_grid_map.items()
        )
        raise ValueError(
            f"rank {stubs[0]} does not participate in any module (stub ranks {stubs} of world "
            f"size {world_size}; modules: {spans}); every rank must run a module"
        )


def validate_data_loader_contract(
    infra: MegatronMIMOInfra | _InfraFields,
    global_batch_size: int,
    micro_batch_size: int,
    num_microbatches: int,
) -> None:
    """Validate data loading constraints for multimodule training.

    Checks that the MIMO micro-batch size and the global batch size are divisible by every
    module's DP size, and that ``num_microbatches * micro_batch_size == global_batch_size``.

    Args:
        infra: MegatronMIMOInfra | _InfraFields with module_to_grid_map.
        global_batch_size: Total MIMO batch size per optimizer step.
        micro_batch_size: Global MIMO batch size per microbatch before module-local DP
            slicing.
        num_microbatches: Number of microbatches per iteration.

    Raises:
        ValueError: If any constraint is violated; the message names the module and sizes.
    """
    for label, value in (
        ("global_batch_size", global_batch_size),
        ("micro_batch_size", micro_batch_size),
        ("num_microbatches", num_microbatches),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{label} must be a positive integer, got {value!r}")
    for name, grid in infra.module_to_grid_map.items():
        dp = _get_dp_size_from_grid(grid)
        if micro_batch_size % dp:
            raise ValueError(
                f"micro_batch_size={micro_batch_size} is not divisible by module {name!r}'s "
                f"data-parallel size {dp}; use a multiple of {dp}"
            )
        if global_batch_size % dp:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by module {name!r}'s "
                f"data-parallel size {dp}; use a multiple of {dp}"
            )
    if num_microbatches * micro_batch_size != global_batch_size:
        raise ValueError(
            f"num_microbatches * micro_batch_size = {num_microbatches} * {micro_batch_size} = "
            f"{num_microbatches * micro_batch_size} != global_batch_size={global_batch_size}"
        )
