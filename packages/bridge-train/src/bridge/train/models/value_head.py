"""A replicated value/reward head for megatron GPT models (RLHF critics, reward models)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from megatron.core import tensor_parallel

from bridge.train.engine._distributed_utils import unwrap_model_chunks

__all__ = [
    "LinearForLastLayer",
    "ModelHook",
    "ModelList",
    "create_value_head_hook",
    "make_value_model",
]

ModelList = list[torch.nn.Module]
"""A list of model chunks (one per virtual pipeline stage)."""

ModelHook = Callable[[ModelList], ModelList | None]
"""A hook run on the model chunks before they are wrapped for data parallelism."""


class LinearForLastLayer(torch.nn.Linear):
    """Final replicated projection head compatible with megatron output-layer calls.

    megatron's ``GPTModel`` calls its ``output_layer`` as
    ``output_layer(hidden, weight=..., runtime_gather_output=...)`` and expects
    ``(output, bias)``. This head accepts those arguments and applies a plain replicated
    ``hidden -> output_size`` projection (no bias); every tensor-parallel rank holds the
    whole weight. With sequence parallelism the projected outputs are gathered along the
    sequence dimension, and the weight is marked ``sequence_parallel`` so its gradient is
    all-reduced over the tensor-parallel group.

    Args:
        input_size: Hidden dimension of the transformer output.
        output_size: Output dimension of the value/reward head.
        sequence_parallel: Whether to gather sequence-parallel activations.
    """

    def __init__(self, input_size: int, output_size: int, sequence_parallel: bool) -> None:
        super().__init__(in_features=input_size, out_features=output_size, bias=False)
        self.sequence_parallel = sequence_parallel
        if sequence_parallel:
            self.weight.sequence_parallel = True  # type: ignore[attr-defined]

    def forward(  # type: ignore[override]
        self,
        input_: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, None]:
        """Project ``input_`` (``[s, b, h]``) and return megatron-style ``(output, None)``.

        Args:
            input_: Hidden states.
            weight: Ignored (megatron passes the shared embedding weight here).
            runtime_gather_output: Ignored (the output is never split).

        Returns:
            ``(output, None)`` with ``output`` in fp32, shape ``[s, b, output_size]``.
        """
        del weight, runtime_gather_output
        output = super().forward(input_).float()
        if self.sequence_parallel:
            output = tensor_parallel.gather_from_sequence_parallel_region(
                output, tensor_parallel_output_grad=False
            )
        return output, None


def create_value_head_hook(
    hidden_size: int, sequence_parallel: bool, output_size: int = 1
) -> ModelHook:
    """Create a pre-wrap hook that replaces the final pipeline stage's output head.

    The returned hook takes the model chunks (a list, or a single module) and sets
    ``output_layer`` of every chunk that runs the last pipeline stage to a
    :class:`LinearForLastLayer` of ``hidden_size -> output_size``. Pass it to the engine's
    ``setup_model(pre_wrap_hooks=[...])`` so the head exists before data-parallel wrapping.

    Args:
        hidden_size: Hidden dimension of the transformer output.
        sequence_parallel: Whether the model uses sequence parallelism.
        output_size: Number of outputs produced by the final head.

    Returns:
        A hook returning the (modified in place) list of model chunks.

    Raises:
        ValueError: ``hidden_size`` or ``output_size`` is not positive.
    """
    if hidden_size <= 0 or output_size <= 0:
        raise ValueError(
            f"create_value_head_hook: hidden_size and output_size must be positive, got "
            f"hidden_size={hidden_size}, output_size={output_size}"
        )

    def hook(model: ModelList | torch.nn.Module) -> ModelList:
        chunks = unwrap_model_chunks(model)
        for chunk in chunks:
            # A megatron model chunk knows whether it runs the last pipeline stage.
            if getattr(chunk, "post_process", True):
                chunk.output_layer = LinearForLastLayer(
                    input_size=hidden_size,
                    output_size=output_size,
                    sequence_parallel=sequence_parallel,
                )
        return chunks

    return hook


def make_value_model(hidden_size: int, sequence_parallel: bool) -> ModelHook:
    """Create a value-head hook with one output (a scalar value per token).

    Args:
        hidden_size: Hidden dimension of the transformer output.
        sequence_parallel: Whether the model uses sequence parallelism.

    Returns:
        The hook of :func:`create_value_head_hook` with ``output_size=1``.
    """
    return create_value_head_hook(hidden_size=hidden_size, sequence_parallel=sequence_parallel)
