"""Weight-gradient helpers for deferred embedding wgrad computation.

With pipeline parallelism, megatron can defer the (large) embedding weight-gradient GEMMs
of the last pipeline stage to the pipeline drain, where the GPU would otherwise idle.
:func:`drain_embedding_wgrad_compute` runs those deferred GEMMs, overlapping the
sequence-parallel all-gather of the next microbatch's activations with the current GEMM.

What runs where: the all-gather runs on any backend (gloo on CPU, nccl on GPU); the GEMM
uses apex's fused ``fused_weight_gradient_mlp_cuda`` kernel when it is installed and the
tensors are on CUDA, and an equivalent ``torch.addmm_`` accumulation into
``weight.main_grad`` otherwise (CPU included). The result is the same:
``main_grad += grad_output^T @ input`` per microbatch.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

import torch
import torch.distributed as dist

from core_utils.distributed import all_gather_into
from core_utils.memory_buffers import GlobalMemoryBuffer

__all__ = [
    "WgradConfig",
    "drain_embedding_wgrad_compute",
    "prepare_input_tensors_for_wgrad_compute",
]

_gather_buffers = GlobalMemoryBuffer()


class WgradConfig(Protocol):
    """What :func:`drain_embedding_wgrad_compute` reads of megatron's ``TransformerConfig``."""

    @property
    def sequence_parallel(self) -> bool:
        """The activations are split along the sequence over the tensor-parallel group."""
        ...

    @property
    def gradient_accumulation_fusion(self) -> bool:
        """Weight gradients accumulate into ``weight.main_grad``."""
        ...


def prepare_input_tensors_for_wgrad_compute(
    grad_output: torch.Tensor, all_gathered_input: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Make both tensors contiguous and fold ``[s, b, h]`` into ``[s * b, h]``.

    Returns:
        ``(grad_output, all_gathered_input)`` ready for a 2-D weight-gradient GEMM.
    """
    grad_output = grad_output.contiguous()
    all_gathered_input = all_gathered_input.contiguous()
    if grad_output.dim() == 3:
        grad_output = grad_output.view(-1, grad_output.shape[2])
        all_gathered_input = all_gathered_input.view(-1, all_gathered_input.shape[2])
    return grad_output, all_gathered_input


def _fused_kernel() -> Any:
    try:
        return importlib.import_module("fused_weight_gradient_mlp_cuda")
    except ImportError:
        return None


def _accumulate_wgrad(
    all_gathered_input: torch.Tensor, grad_output: torch.Tensor, weight: torch.nn.Parameter
) -> None:
    grad_output, all_gathered_input = prepare_input_tensors_for_wgrad_compute(
        grad_output, all_gathered_input
    )
    if hasattr(weight, "__fsdp_param__"):
        weight.main_grad = weight.get_main_grad()  # type: ignore[attr-defined]
    main_grad: torch.Tensor | None = getattr(weight, "main_grad", None)
    if main_grad is None:
        raise ValueError(
            "drain_embedding_wgrad_compute: weight has no main_grad buffer; gradient "
            "accumulation fusion accumulates into weight.main_grad (set up by megatron DDP)"
        )
    kernel = _fused_kernel() if main_grad.is_cuda else None
    if kernel is not None and main_grad.dtype == torch.float32:
        kernel.wgrad_gemm_accum_fp32(all_gathered_input, grad_output, main_grad)
    elif kernel is not None and main_grad.dtype in (torch.float16, torch.bfloat16):
        kernel.wgrad_gemm_accum_fp16(all_gathered_input, grad_output, main_grad)
    elif main_grad.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        main_grad.addmm_(
            grad_output.t().to(main_grad.dtype), all_gathered_input.to(main_grad.dtype)
        )
    else:
        raise ValueError(
            f"drain_embedding_wgrad_compute: unsupported main_grad dtype {main_grad.dtype}; "
            "use float32, float16 or bfloat16"
        )


def drain_embedding_wgrad_compute(
    config: WgradConfig,
    embedding_activation_buffer: list[torch.Tensor],
    grad_output_buffer: list[torch.Tensor],
    weight: torch.nn.Parameter,
    tp_group: dist.ProcessGroup | None,
) -> None:
    """Run the deferred embedding weight-gradient GEMMs, overlapping all-gathers and GEMMs.

    Pops every entry of both buffers (they are emptied), and for each microbatch adds
    ``grad_output^T @ input`` to ``weight.main_grad``, where ``input`` is the activation
    all-gathered along the sequence dimension over ``tp_group`` when
    ``config.sequence_parallel`` is set. Only for pipeline parallelism with gradient
    accumulation fusion (megatron's ``defer_embedding_wgrad_compute``).

    Args:
        config: Has ``sequence_parallel`` and ``gradient_accumulation_fusion`` (a megatron
            ``TransformerConfig`` or any object with those attributes).
        embedding_activation_buffer: Saved activations, one per microbatch.
        grad_output_buffer: Matching output gradients, one per microbatch.
        weight: The embedding / output weight with a ``main_grad`` buffer.
        tp_group: Tensor-parallel group for the sequence-parallel all-gather.

    Raises:
        ValueError: The buffers differ in length or are empty, gradient accumulation
            fusion is off, or ``weight`` has no ``main_grad``.
    """
    if len(embedding_activation_buffer) != len(grad_output_buffer):
        raise ValueError(
            "drain_embedding_wgrad_compute: embedding_activation_buffer has "
            f"{len(embedding_activation_buffer)} entries but grad_output_buffer has "
            f"{len(grad_output_buffer)}; they must match (one per microbatch)"
        )
    if not embedding_activation_buffer:
        raise ValueError("drain_embedding_wgrad_compute: the buffers are empty")
    if not getattr(config, "gradient_accumulation_fusion", False):
        raise ValueError(
            "drain_embedding_wgrad_compute needs config.gradient_accumulation_fusion=True "
            "(deferred embedding wgrad accumulates into weight.main_grad)"
        )
    sequence_parallel = bool(getattr(config, "sequence_parallel", False))

    def gather(activation: torch.Tensor, slot: int) -> tuple[torch.Tensor, dist.Work | None]:
        if not sequence_parallel:
            return activation, None
        world_size = dist.get_world_size(tp_group)
        shape = [activation.shape[0] * world_size, *activation.shape[1:]]
        buffer = _gather_buffers.get_tensor(
            shape, activation.dtype, f"mpu_{slot}", device=activation.device
        )
        work = all_gather_into(buffer, activation.contiguous(), group=tp_group, async_op=True)
        return buffer, work

    # Double buffering: slot (i + 1) % 2 is being gathered while slot i % 2 feeds the GEMM.
    gathered: list[torch.Tensor | None] = [None, None]
    pending: list[dist.Work | None] = [None, None]
    gathered[0], pending[0] = gather(embedding_activation_buffer.pop(0), 0)
    step = 0
    while True:
        slot = step % 2
        if embedding_activation_buffer:
            nxt = (step + 1) % 2
            gathered[nxt], pending[nxt] = gather(embedding_activation_buffer.pop(0), nxt)
        work = pending[slot]
        if work is not None:
            work.wait()
        current = gathered[slot]
        if current is None:  # pragma: no cover - the loop always fills the slot first
            raise RuntimeError("drain_embedding_wgrad_compute: activation slot is empty")
        _accumulate_wgrad(current, grad_output_buffer.pop(0), weight)
        gathered[slot], pending[slot] = None, None
        step += 1
        if not grad_output_buffer:
            break
