"""What every model provider checks and settles before it builds a megatron model chunk."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state

__all__ = ["prepare_to_build"]


def prepare_to_build(
    provider: Any,
    pre_process: bool | None,
    post_process: bool | None,
    vp_stage: int | None,
) -> tuple[bool, bool]:
    """Check megatron's parallel state against ``provider`` and settle the chunk's ends.

    Also switches ``provider.use_cpu_initialization`` on without CUDA, so weights are drawn
    on the CPU and tensor-parallel shards are slices of the full weights one process draws.

    Args:
        provider: The model provider (also the model's ``TransformerConfig``).
        pre_process: Build the embedding; ``None``: this rank runs the first pipeline stage.
        post_process: Build the output layer; ``None``: this rank runs the last stage.
        vp_stage: Virtual pipeline stage of the chunk.

    Returns:
        ``(pre_process, post_process)``.

    Raises:
        RuntimeError: The parallel state is not initialised, or its tensor-parallel size
            differs from ``provider.tensor_model_parallel_size``.
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
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(
            ignore_virtual=False, vp_stage=vp_stage
        )
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(
            ignore_virtual=False, vp_stage=vp_stage
        )
    return bool(pre_process), bool(post_process)
