"""Rotary position embeddings that stay on the CPU when there is no GPU.

megatron-core 0.19's ``RotaryEmbedding.get_emb`` moves its frequencies to
``torch.cuda.current_device()`` on the first forward, which raises without CUDA. On a
machine without CUDA, :func:`keep_rotary_on_cpu` switches a model's rotary modules to
:class:`CPURotaryEmbedding`, which runs that method inside ``core_utils.cpu_cuda_compat()``
(where the current device is the CPU), and megatron's ``YarnRotaryEmbedding`` (which moves
its two frequency tables the same way) to :class:`CPUYarnRotaryEmbedding`. With CUDA nothing
is changed.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

from core_utils import cpu_cuda_compat

__all__ = ["CPURotaryEmbedding", "CPUYarnRotaryEmbedding", "keep_rotary_on_cpu"]


class CPURotaryEmbedding(RotaryEmbedding):
    """``RotaryEmbedding`` whose frequencies stay on the CPU without CUDA."""

    def get_emb(self, max_seq_len: int, offset: int = 0) -> Any:
        """megatron's ``get_emb`` (YaRN's in :class:`CPUYarnRotaryEmbedding`: frequencies and
        attention factor) with the CPU as the current CUDA device."""
        with cpu_cuda_compat():
            return super().get_emb(max_seq_len, offset)


class CPUYarnRotaryEmbedding(CPURotaryEmbedding, YarnRotaryEmbedding):
    """``YarnRotaryEmbedding`` whose frequencies stay on the CPU without CUDA."""


_CPU_CLASSES: dict[type, type] = {
    RotaryEmbedding: CPURotaryEmbedding,
    YarnRotaryEmbedding: CPUYarnRotaryEmbedding,
}


def keep_rotary_on_cpu(model: torch.nn.Module) -> None:
    """Make every megatron ``RotaryEmbedding`` / ``YarnRotaryEmbedding`` in ``model`` (the
    model's, or an attention layer's own, as multi-latent attention has) work without CUDA
    (in place)."""
    if torch.cuda.is_available():
        return
    for module in model.modules():
        replacement = _CPU_CLASSES.get(type(module))
        if replacement is not None:
            module.__class__ = replacement
