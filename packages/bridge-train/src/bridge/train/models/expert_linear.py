"""Biased local experts that train: megatron-core 0.19's expert MLP with a bias.

megatron's ``MLP`` adds an expert's output bias in place (``output += bias * prob``) to
what its ``linear_fc2`` returned. Without expert tensor parallelism that
``RowParallelLinear``'s reduction over the one-rank group returns its input as it is, which
autograd then treats as a view made inside a custom ``Function`` and refuses to modify in
place ("Output 0 of _ReduceFromModelParallelRegion is a view and is being modified
inplace"), so a biased MoE model (gpt-oss) cannot take a training step with megatron's
local experts (``SequentialMLP``) on any device. :class:`ExpertRowParallelLinear` returns
a copy of that output instead; layer specs use it as the experts' ``linear_fc2`` when the
model has biases (:func:`bridge.train.models.layer_specs.build_gpt_layer_spec`).
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import RowParallelLinear

__all__ = ["ExpertRowParallelLinear"]


class ExpertRowParallelLinear(RowParallelLinear):
    """megatron's ``RowParallelLinear`` whose output may be modified in place (a copy when
    the reduction handed back its input). Same parameters, names and checkpoints."""

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """megatron's forward, then a fresh output tensor (see the module docstring)."""
        output, bias = super().forward(input_)
        return output.clone(), bias
