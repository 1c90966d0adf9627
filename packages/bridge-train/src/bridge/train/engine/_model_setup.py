"""Model-chunk construction shared by both engines (internal)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from bridge.config import ModelConfigProtocol


def build_model_chunks(
    model_provider: Any,
    vp_size: int | None,
    pre_wrap_hooks: Sequence[Callable[[list[torch.nn.Module]], Any]],
) -> list[torch.nn.Module]:
    """Call ``model_provider.provide`` once per virtual pipeline stage and run the hooks."""
    if vp_size is None:
        chunks = [model_provider.provide()]
    else:
        chunks = [model_provider.provide(vp_stage=stage) for stage in range(vp_size)]
    for hook in pre_wrap_hooks:
        result = hook(chunks)
        if result is not None:
            chunks = list(result) if isinstance(result, (list, tuple)) else [result]
    # megatron's distributed checkpointing and schedules expect this attribute.
    from megatron.core.tensor_parallel import (
        set_defaults_if_not_set_tensor_model_parallel_attributes,
    )

    for chunk in chunks:
        for param in chunk.parameters():
            set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    return chunks


def cast_for_precision(
    chunks: list[torch.nn.Module], model_config: ModelConfigProtocol
) -> list[torch.nn.Module]:
    """Wrap chunks in megatron's ``Float16Module`` for bf16/fp16 (inputs cast in, fp32 out)."""
    if not (getattr(model_config, "bf16", False) or getattr(model_config, "fp16", False)):
        return chunks
    from megatron.core.transformer.module import Float16Module

    return [Float16Module(model_config, chunk) for chunk in chunks]
