"""The engine's model chunks: one per virtual stage, drawn layout-independently, cast (internal)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from megatron.core.tensor_parallel import set_defaults_if_not_set_tensor_model_parallel_attributes
from megatron.core.transformer.module import Float16Module

from bridge.train.models.layout_init import check_supported, initialize_layout_independent

if TYPE_CHECKING:
    from bridge.config import ModelConfigProtocol


def build_model_chunks(
    model_provider: Any,
    vp_size: int | None,
    pre_wrap_hooks: Sequence[Callable[[list[torch.nn.Module]], Any]],
    layout_independent_seed: int | None = None,
) -> list[torch.nn.Module]:
    """Call ``model_provider.provide`` once per virtual pipeline stage and run the hooks.

    With ``layout_independent_seed`` the chunks are built without megatron's own draw
    (``perform_initialization`` off for the build) and drawn layout-independently; a
    provider whose ``perform_initialization`` is already off (weights loaded later) is left
    undrawn, as megatron would.
    """
    draw = layout_independent_seed is not None and bool(
        getattr(model_provider, "perform_initialization", True)
    )
    if draw:
        check_supported(model_provider)
        model_provider.perform_initialization = False
    try:
        if vp_size is None:
            chunks = [model_provider.provide()]
        else:
            chunks = [model_provider.provide(vp_stage=stage) for stage in range(vp_size)]
    finally:
        if draw:
            model_provider.perform_initialization = True
    if draw:
        assert layout_independent_seed is not None
        initialize_layout_independent(chunks, model_provider, layout_independent_seed)
    for hook in pre_wrap_hooks:
        result = hook(chunks)
        if result is not None:
            chunks = list(result) if isinstance(result, (list, tuple)) else [result]
    # megatron's distributed checkpointing and schedules expect this attribute.

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

    return [Float16Module(model_config, chunk) for chunk in chunks]
