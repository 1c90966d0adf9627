"""Rotary position embeddings that stay on the CPU when there is no GPU.

megatron-core 0.19's ``RotaryEmbedding.get_emb`` moves its frequencies to
``torch.cuda.current_device()`` on the first forward, which raises without CUDA. On a
machine without CUDA, :func:`keep_rotary_on_cpu` switches a model's rotary modules to
:class:`CPURotaryEmbedding`, which runs that method inside ``core_utils.cpu_cuda_compat()``
(where the current device is the CPU). With CUDA nothing is changed.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from core_utils import cpu_cuda_compat

__all__ = ["CPURotaryEmbedding", "keep_rotary_on_cpu"]


class CPURotaryEmbedding(RotaryEmbedding):
    """``RotaryEmbedding`` whose frequencies stay on the CPU without CUDA."""

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        """megatron's ``get_emb`` with the CPU as the current CUDA device."""
        with cpu_cuda_compat():
            return super().get_emb(max_seq_len, offset)


def keep_rotary_on_cpu(model: torch.nn.Module) -> None:
    """Make every megatron ``RotaryEmbedding`` in ``model`` work without CUDA (in place)."""
    if torch.cuda.is_available():
        return
    for module in model.modules():
        if type(module) is RotaryEmbedding:
            module.__class__ = CPURotaryEmbedding
