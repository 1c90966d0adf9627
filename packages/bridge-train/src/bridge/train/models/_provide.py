"""What every model provider checks and settles before it builds a megatron model chunk."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.transformer.spec_utils import ModuleSpec

__all__ = ["call_layer_spec", "prepare_to_build"]


def call_layer_spec(spec: Any, provider: Any, vp_stage: int | None) -> Any:
    """A user's layer spec: as given, or, when it is a callable, called with the provider
    (and ``vp_stage`` when it takes one)."""
    if isinstance(spec, ModuleSpec) or not callable(spec):
        return spec
    if "vp_stage" in inspect.signature(spec).parameters:
        return spec(provider, vp_stage=vp_stage)
    return spec(provider)


def prepare_to_build(
    provider: Any,
    pre_process: bool | None,
    post_process: bool | None,
    vp_stage: int | None,
    *,
    spec_given: bool,
) -> tuple[bool, bool]:
    """Check megatron's parallel state against ``provider`` and settle the chunk's ends.

    Also switches ``provider.use_cpu_initialization`` on without CUDA, so weights are drawn
    on the CPU and tensor-parallel shards are slices of the full weights one process draws,
    and, unless the user gave the layer spec, sets ``provider.transformer_impl`` to the
    layers its resolved backend builds (megatron's modules read it).

    Args:
        provider: The model provider (also the model's ``TransformerConfig``).
        pre_process: Build the embedding; ``None``: this rank runs the first pipeline stage.
        post_process: Build the output layer; ``None``: this rank runs the last stage.
        vp_stage: Virtual pipeline stage of the chunk.
        spec_given: The user gave the layer spec (``transformer_impl`` is then theirs).

    Returns:
        ``(pre_process, post_process)``.

    Raises:
        RuntimeError: The parallel state is not initialised, or its tensor-parallel size
            differs from ``provider.tensor_model_parallel_size``.
        ValueError: The provider's layer backend cannot run here.
    """

    name = type(provider).__name__
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            f"{name}.provide() needs megatron's parallel state: call "
            "bridge.train.engine.initialize.initialize_distributed(...) (or megatron.core.parallel_state."
            "initialize_model_parallel) first"
        )
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp != provider.tensor_model_parallel_size:
        raise RuntimeError(
            f"model.tensor_model_parallel_size={provider.tensor_model_parallel_size} but the "
            f"initialised tensor-parallel group has {tp} ranks; initialise the parallel "
            "state from this config"
        )
    if not torch.cuda.is_available():
        provider.use_cpu_initialization = True
    if not spec_given:
        backend = provider.resolved_layer_spec_backend()
        provider.transformer_impl = (
            "transformer_engine" if backend == "transformer_engine" else "local"
        )
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(
            ignore_virtual=False, vp_stage=vp_stage
        )
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(
            ignore_virtual=False, vp_stage=vp_stage
        )
    return bool(pre_process), bool(post_process)
