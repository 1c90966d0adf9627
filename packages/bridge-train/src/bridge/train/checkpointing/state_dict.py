"""What a checkpoint holds: the sharded state dict a save writes and a load's template.

A checkpoint's state dict (megatron-core dist_checkpointing) is::

    model (model0, model1, ... with several chunks)   model.sharded_state_dict()
    optimizer                                         optimizer.sharded_state_dict(model ...)
    rng_state                                         one ShardedObject per global rank
    iteration, num_floating_point_operations_so_far   plain values (the "common" state)
    train_state, opt_param_scheduler                  plain values
    bridge_checkpoint                                 format version, parallel layout, content

Sharded tensors follow each parameter's tensor/pipeline-parallel sharding, so
dist_checkpointing reshards on load (TP=2 -> TP=1 and back); optimizer state is wrapped
with its parameter's sharding, never stored as a plain per-rank tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from megatron.core import parallel_state
from megatron.core.utils import unwrap_model

from bridge.train.checkpointing.rng import RNG_STATE_KEY, capture_rng_state, rng_sharded_object
from bridge.train.state import TrainState
from core_utils.distributed import global_world_size

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

__all__ = [
    "FORMAT_VERSION",
    "LAYOUT_SIZES",
    "OPTIMIZER_SHARDING_METADATA",
    "build_save_state_dict",
    "distributed_parts",
    "model_state_keys",
    "optimizer_format",
    "optimizer_parts",
    "optimizer_sharded_state_dict",
    "parallel_layout",
    "sharded_entries",
    "unwrapped_chunks",
]

# Version of the checkpoint content written by this module.
FORMAT_VERSION = 1
META_KEY = "bridge_checkpoint"


def model_state_keys(num_chunks: int) -> list[str]:
    """``["model"]`` for one chunk, else ``["model0", "model1", ...]`` (megatron's keys)."""
    return ["model"] if num_chunks == 1 else [f"model{i}" for i in range(num_chunks)]


#: The model-parallel sizes a checkpoint records: short name (``TP2`` in messages), layout
#: key, megatron's getter.
LAYOUT_SIZES: tuple[tuple[str, str, Callable[[], int]], ...] = (
    ("TP", "tensor_model_parallel_size", parallel_state.get_tensor_model_parallel_world_size),
    ("PP", "pipeline_model_parallel_size", parallel_state.get_pipeline_model_parallel_world_size),
    ("CP", "context_parallel_size", parallel_state.get_context_parallel_world_size),
    ("DP", "data_parallel_size", parallel_state.get_data_parallel_world_size),
    ("EP", "expert_model_parallel_size", parallel_state.get_expert_model_parallel_world_size),
    ("ETP", "expert_tensor_parallel_size", parallel_state.get_expert_tensor_parallel_world_size),
)


def parallel_layout(model: list[torch.nn.Module] | None = None) -> dict[str, Any]:
    """World size and model-parallel sizes (expert sizes included) of the running job.

    A model chunk whose parallelism is not megatron's global parallel state (a MIMO model:
    one grid per module) describes itself through a ``checkpoint_parallel_layout()`` method
    returning JSON-able entries, which are added.
    """
    layout: dict[str, Any] = {"world_size": global_world_size()}
    if parallel_state.model_parallel_is_initialized():
        layout.update({name: size() for _, name, size in LAYOUT_SIZES})
    for chunk in unwrapped_chunks(model or []):
        describe = getattr(chunk, "checkpoint_parallel_layout", None)
        if callable(describe):
            layout.update(describe())
    return layout


def unwrapped_chunks(model: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The model chunks without megatron's DDP / FSDP / ``Float16Module`` wrappers.

    megatron's ``DistributedDataParallel`` has no ``sharded_state_dict`` of its own (the
    generic one would prefix every key with ``module.``) and its ``load_state_dict``
    forwards to the wrapped module, so checkpoints read and write the unwrapped chunks, as
    Megatron-LM does. Other wrappers are left as they are.
    """
    return [unwrap_model(chunk) for chunk in model]


def model_sharded_state_dict(model: list[torch.nn.Module]) -> dict[str, Any]:
    """``{"model": chunk.sharded_state_dict()}`` (one key per chunk with several chunks)."""
    model = unwrapped_chunks(model)
    keys = model_state_keys(len(model))
    result: dict[str, Any] = {}
    for index, (key, chunk) in enumerate(zip(keys, model, strict=True)):
        if len(model) > 1:
            parallel_state.set_virtual_pipeline_model_parallel_rank(index)
        sharded = getattr(chunk, "sharded_state_dict", None)
        if sharded is None:
            raise TypeError(
                f"model chunk {index} ({type(chunk).__name__}) has no sharded_state_dict(); "
                "checkpoints need megatron-core modules (MegatronModule) or a wrapper that "
                "forwards sharded_state_dict"
            )
        result[key] = sharded()
    if len(model) > 1:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    return result


# megatron's distributed optimizer: its state in model space ("fully_reshardable": each
# parameter's exp_avg / exp_avg_sq / fp32 main copy saved under the parameter's own sharded
# key, gathered over the data-parallel group when saving), which reshards across every TP,
# PP, VPP, EP and DP size like the model. Checkpoints written before #24 hold
# "dp_reshardable" state (per data-parallel bucket, reshardable across DP sizes only); they
# are loaded with that type (see ``load._check_reshardable``). Chained optimizers add no
# per-optimizer key prefix.
OPTIMIZER_SHARDING_METADATA: dict[str, Any] = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "chained_optim_avoid_prefix": True,
}


def optimizer_sharded_state_dict(
    optimizer: MegatronOptimizer,
    model_state: dict[str, Any],
    *,
    is_loading: bool = False,
    sharding_type: str | None = None,
) -> Any:
    """``optimizer.sharded_state_dict`` with :data:`OPTIMIZER_SHARDING_METADATA`.

    Args:
        optimizer: megatron-core's optimizer (or another with its ``sharded_state_dict``).
        model_state: The model's sharded state dict (see :func:`model_sharded_state_dict`).
        is_loading: Build the template to load into.
        sharding_type: The distributed optimizer's sharding type to use instead of the
            default (to load a checkpoint saved with another, e.g. ``"dp_reshardable"``).

    Returns:
        The optimizer's sharded state dict.
    """
    metadata = dict(OPTIMIZER_SHARDING_METADATA)
    if sharding_type is not None:
        metadata["distrib_optim_sharding_type"] = sharding_type
    return optimizer.sharded_state_dict(model_state, is_loading, metadata=metadata)


def optimizer_parts(optimizer: MegatronOptimizer) -> list[Any]:
    """A ``ChainedOptimizer``'s parts (dense and expert-parallel), else ``[optimizer]``."""
    return getattr(optimizer, "chained_optimizers", None) or [optimizer]


def distributed_parts(optimizer: MegatronOptimizer) -> list[Any]:
    """The parts of ``optimizer`` that are megatron's ``DistributedOptimizer``."""
    return [p for p in optimizer_parts(optimizer) if type(p).__name__ == "DistributedOptimizer"]


def allocate_optimizer_state(optimizer: MegatronOptimizer) -> None:
    """Give a fresh megatron distributed optimizer the state tensors a load overwrites.

    megatron's ``DistributedOptimizer.sharded_state_dict(is_loading=True)`` reads its own
    ``state_dict()``, which with torch's optimizers (no Apex / Transformer Engine, as on
    CPU) asserts that every parameter's state has a ``step``; a freshly built optimizer has
    no state at all. This allocates zero state (megatron's ``init_state_fn``) and step 0,
    the values a load then replaces; an optimizer that already has state is left alone.
    """
    for inner in distributed_parts(optimizer):
        torch_optimizer = inner.optimizer
        if len(torch_optimizer.state) > 0:
            continue
        init_state_fn = getattr(inner, "init_state_fn", None)
        if init_state_fn is not None:
            init_state_fn(torch_optimizer, inner.config)
        for group in torch_optimizer.param_groups:
            for param in group["params"]:
                torch_optimizer.state[param].setdefault(
                    "step", torch.tensor(0.0, dtype=torch.float32)
                )


def optimizer_format(optimizer: MegatronOptimizer) -> str:
    """How the optimizer's state is laid out in a checkpoint, for the resharding rules.

    ``"distributed:<sharding type>"`` for megatron's distributed optimizer (also chained),
    ``"megatron"`` for megatron's other optimizers. (Checkpoints of the retired portable
    engine say ``"portable"``: per-parameter state with megatron's keys, converted like any
    other format; see :mod:`~bridge.train.checkpointing.optimizer_conversion`.)
    """
    if distributed_parts(optimizer):
        return f"distributed:{OPTIMIZER_SHARDING_METADATA['distrib_optim_sharding_type']}"
    return "megatron"


def sharded_entries(
    model: list[torch.nn.Module],
    optimizer: MegatronOptimizer | None,
    *,
    rng: bool,
    saved: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A checkpoint's sharded entries: model chunks, optimizer state, this rank's RNG state.

    What a save writes or, given ``saved``, the template a load reads into: this run's
    shapes and shardings, the optimizer's state allocated first (so there is state to load
    into) and sharded as the checkpoint's distributed optimizer was.

    Args:
        model: Model chunks.
        optimizer: The optimizer whose state is included, or None.
        rng: Include this rank's generator states.
        saved: Loading: the checkpoint's ``bridge_checkpoint`` record.
    """
    loading = saved is not None
    models = model_sharded_state_dict(model)
    entries: dict[str, Any] = dict(models)
    if optimizer is not None:
        if loading:
            allocate_optimizer_state(optimizer)
        saved_fmt = (saved or {}).get("optimizer_format") or ""
        entries["optimizer"] = optimizer_sharded_state_dict(
            optimizer,
            models,
            is_loading=loading,
            # The distributed-optimizer sharding type the checkpoint was saved with, if any.
            sharding_type=saved_fmt.partition("distributed:")[2] or None,
        )
    if rng:
        entries[RNG_STATE_KEY] = rng_sharded_object(None if loading else capture_rng_state())
    return entries


def build_save_state_dict(
    model: list[torch.nn.Module],
    optimizer: MegatronOptimizer | None,
    opt_param_scheduler: OptimizerParamScheduler | None,
    train_state: TrainState,
    num_floating_point_operations_so_far: float,
    *,
    save_optim: bool,
    save_rng: bool,
) -> dict[str, Any]:
    """The sharded state dict one rank contributes to a checkpoint.

    Args:
        model: Model chunks.
        optimizer: Optimizer with ``sharded_state_dict(model_sharded_state_dict)``, or None.
        opt_param_scheduler: Scheduler with ``state_dict()``, or None.
        train_state: Progress counters to store.
        num_floating_point_operations_so_far: FLOPs so far (also stored in the train state).
        save_optim: Include optimizer (and scheduler) state.
        save_rng: Include this rank's generator states.

    Returns:
        A state dict accepted by ``megatron.core.dist_checkpointing.save``.
    """
    has_optimizer = bool(save_optim and optimizer is not None)
    state = sharded_entries(model, optimizer if has_optimizer else None, rng=save_rng)
    train = train_state.state_dict()
    train["floating_point_operations_so_far"] = torch.tensor(
        float(num_floating_point_operations_so_far), dtype=torch.float64
    )
    if opt_param_scheduler is not None:
        state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    state["iteration"] = int(train_state.step)
    state["num_floating_point_operations_so_far"] = float(num_floating_point_operations_so_far)
    state["train_state"] = train
    state[META_KEY] = {
        "version": FORMAT_VERSION,
        "parallel_layout": parallel_layout(model),
        "model_chunks": len(model),
        "optimizer": has_optimizer,
        "optimizer_format": optimizer_format(optimizer) if has_optimizer else None,
        # megatron's dense and expert-parallel optimizers (chained): how many were saved.
        "optimizer_parts": len(optimizer_parts(optimizer)) if has_optimizer else None,
        "opt_param_scheduler": opt_param_scheduler is not None,
        "rng": bool(save_rng),
    }
    return state
