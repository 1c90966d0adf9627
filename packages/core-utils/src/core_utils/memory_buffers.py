"""Reusable scratch buffers: a per-name global buffer and a symmetric-memory buffer."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from core_utils.distributed import dist_ready

__all__ = ["GlobalMemoryBuffer", "GlobalSymmetricMemoryBuffer"]

logger = logging.getLogger(__name__)


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _numel(tensor_shape: Sequence[int], caller: str) -> int:
    shape = tuple(int(d) for d in tensor_shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"{caller}: tensor_shape must not have negative sizes, got {shape}")
    return math.prod(shape)


def _shape(tensor_shape: Sequence[int]) -> tuple[int, ...]:
    # A tuple, not unpacked arguments: ``view(*())`` would be ``view()``, which torch rejects,
    # while ``view(())`` gives the 0-d tensor a scalar shape asks for.
    return tuple(int(d) for d in tensor_shape)


class GlobalMemoryBuffer:
    """Scratch buffers reused across calls, one per ``(name, dtype)``.

    :meth:`get_tensor` returns a view of the first ``prod(shape)`` elements of the buffer
    for ``(name, dtype)``, allocating it on first use and re-allocating (larger) only when
    a request does not fit. Two users of the same name share storage: the caller must not
    use one name for tensors that are alive at the same time.
    """

    def __init__(self) -> None:
        self.buffer: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get_tensor(
        self,
        tensor_shape: Sequence[int],
        dtype: torch.dtype,
        name: str,
        mem_alloc_context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Return a tensor of ``tensor_shape`` backed by the ``(name, dtype)`` buffer.

        Args:
            tensor_shape: Shape of the tensor wanted.
            dtype: Its dtype.
            name: Buffer name; different names never share storage.
            mem_alloc_context: Factory of a context manager entered around a (re)allocation,
                e.g. a CUDA memory pool.
            device: Where the buffer lives; default the current CUDA device when CUDA is
                available, else the CPU. A buffer on another device is re-allocated.

        Returns:
            A view into the buffer (contents are whatever was last written there).
        """
        required = _numel(tensor_shape, "GlobalMemoryBuffer.get_tensor")
        target = torch.device(device) if device is not None else _default_device()
        key = (name, dtype)
        current = self.buffer.get(key)
        if current is None or current.numel() < required or current.device != target:
            context = mem_alloc_context() if mem_alloc_context else contextlib.nullcontext()
            with context:
                self.buffer[key] = torch.empty(
                    required, dtype=dtype, device=target, requires_grad=False
                )
        return self.buffer[key][:required].view(_shape(tensor_shape))


class GlobalSymmetricMemoryBuffer:
    """A buffer in torch symmetric memory, shared with the peers of ``process_group``.

    Symmetric memory (``torch.distributed._symmetric_memory``) lets kernels read and write
    peer GPUs' buffers directly (low-latency all-gather / reduce-scatter). It needs CUDA
    and a backend supporting it; where it is unavailable (CPU, old torch, no NVLink, no
    process group) the buffer is simply absent: :meth:`maybe_get_tensor` returns ``None`` and
    callers use their regular path. :attr:`unavailable_reason` says why.

    Args:
        size_in_mb: Buffer size in MiB.
        process_group: Group the memory is shared with (collective: every member must
            construct the buffer); ``None`` means the default group, and without one the
            buffer is unavailable.

    Raises:
        ValueError: ``size_in_mb`` is not positive.
    """

    def __init__(self, size_in_mb: float, process_group: dist.ProcessGroup | None) -> None:
        if not size_in_mb > 0:
            raise ValueError(
                f"GlobalSymmetricMemoryBuffer: size_in_mb must be > 0, got {size_in_mb}"
            )
        self.size_in_bytes = int(size_in_mb * 1024 * 1024)
        self.symm_buffer: torch.Tensor | None = None
        self.symm_mem_hdl: Any = None
        self.unavailable_reason: str | None = None
        if not torch.cuda.is_available():
            self.unavailable_reason = "symmetric memory needs CUDA, which is not available"
            return
        try:
            import torch.distributed._symmetric_memory as symm_mem
        except ImportError as exc:  # pragma: no cover - every supported torch has it
            self.unavailable_reason = f"torch has no symmetric memory support: {exc}"
            return
        if process_group is None and not dist_ready():
            self.unavailable_reason = (
                "symmetric memory is shared with a process group: process_group is None and "
                "torch.distributed is not initialised (call init_process_group first)"
            )
            return
        try:
            group = (
                process_group
                if process_group is not None
                else dist.distributed_c10d._get_default_group()
            )
            buffer = symm_mem.empty(self.size_in_bytes, dtype=torch.uint8, device=_default_device())
            self.symm_mem_hdl = symm_mem.rendezvous(buffer, group)
            self.symm_buffer = buffer
        except (RuntimeError, ValueError, AttributeError) as exc:
            self.unavailable_reason = f"symmetric memory allocation failed: {exc}"
            logger.warning("GlobalSymmetricMemoryBuffer disabled: %s", exc)

    def _can_allocate(self, numel: int, dtype: torch.dtype) -> bool:
        """Return whether ``numel`` elements of ``dtype`` fit in the symmetric buffer."""
        if self.symm_buffer is None or self.symm_mem_hdl is None:
            return False
        element_size = torch.empty((), dtype=dtype).element_size()
        return numel * element_size <= self.symm_buffer.numel()

    def _allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Return the first ``numel`` elements of the buffer reinterpreted as ``dtype``."""
        if self.symm_buffer is None:
            raise RuntimeError(
                f"GlobalSymmetricMemoryBuffer is unavailable: {self.unavailable_reason}"
            )
        element_size = torch.empty((), dtype=dtype).element_size()
        return self.symm_buffer[: numel * element_size].view(dtype)

    def maybe_get_tensor(
        self, tensor_shape: Sequence[int], dtype: torch.dtype
    ) -> torch.Tensor | None:
        """Return a ``tensor_shape`` view of the symmetric buffer, or ``None`` if it does not
        fit or symmetric memory is unavailable (the handle is :attr:`symm_mem_hdl`)."""
        numel = _numel(tensor_shape, "GlobalSymmetricMemoryBuffer.maybe_get_tensor")
        if not self._can_allocate(numel, dtype):
            return None
        return self._allocate(numel, dtype).view(_shape(tensor_shape))
