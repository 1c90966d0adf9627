"""Pure-torch stand-ins for apex's ``amp_C`` multi-tensor kernels.

Same argument order and return values as ``amp_C.multi_tensor_l2norm`` and
``amp_C.multi_tensor_scale`` (and apex's ``multi_tensor_applier``), so optimizer and
grad-clipping code written against apex runs without it, on CPU or GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["local_multi_tensor_applier", "local_multi_tensor_l2_norm", "local_multi_tensor_scale"]

# apex's default chunk size; the pure-torch ops ignore it.
_CHUNK_SIZE = 2048 * 32


def local_multi_tensor_applier(
    op: Callable[..., Any],
    noop_flag_buffer: torch.Tensor,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    *args: Any,
) -> Any:
    """Call ``op(chunk_size, noop_flag_buffer, tensor_lists, *args)`` like apex's applier."""
    return op(_CHUNK_SIZE, noop_flag_buffer, tensor_lists, *args)


def local_multi_tensor_l2_norm(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    per_tensor: bool,
    *args: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compute the L2 norm over all tensors of ``tensor_lists`` (as ``amp_C.multi_tensor_l2norm``).

    Norms are accumulated in float32 whatever the tensors' dtype.

    Args:
        chunk_size: Ignored (apex's kernel chunking).
        noop_flag: Ignored (apex's l2norm does not read it either).
        tensor_lists: ``[tensors]``; further lists, if given, are included in the norm.
        per_tensor: Also return each tensor's norm.

    Returns:
        ``(total_norm, per_tensor_norms)``: a float32 tensor of shape ``[1]`` and a float32
        tensor with one norm per tensor (shape ``[0]`` when ``per_tensor`` is False), on the
        tensors' device.
    """
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    device = tensors[0].device if tensors else torch.device("cpu")
    if not tensors:
        empty = torch.zeros(0, dtype=torch.float32, device=device)
        return torch.zeros(1, dtype=torch.float32, device=device), empty
    norms = torch.stack(
        [torch.linalg.vector_norm(t.detach(), dtype=torch.float32).to(device) for t in tensors]
    )
    total = torch.linalg.vector_norm(norms).reshape(1)
    per = norms if per_tensor else torch.zeros(0, dtype=torch.float32, device=device)
    return total, per


def local_multi_tensor_scale(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    scale: float,
) -> None:
    """Write ``src * scale`` into ``dst`` for each pair (as ``amp_C.multi_tensor_scale``).

    Like apex's kernel it reports overflow: if any result is inf or NaN, ``noop_flag`` is
    set to 1 (the scaled values are still written).

    Args:
        chunk_size: Ignored (apex's kernel chunking).
        noop_flag: One-element int tensor, set to 1 on a non-finite result.
        tensor_lists: ``[sources, destinations]`` of equal length and matching shapes.
        scale: Multiplier.

    Raises:
        ValueError: ``tensor_lists`` is not two lists of equal length, or a pair's shapes
            differ.
    """
    if len(tensor_lists) != 2:
        raise ValueError(
            f"local_multi_tensor_scale: tensor_lists must be [sources, destinations], "
            f"got {len(tensor_lists)} lists"
        )
    sources, destinations = tensor_lists
    if len(sources) != len(destinations):
        raise ValueError(
            f"local_multi_tensor_scale: {len(sources)} sources but {len(destinations)} "
            "destinations; give one destination per source"
        )
    finite = True
    with torch.no_grad():
        for i, (src, dst) in enumerate(zip(sources, destinations, strict=True)):
            if src.shape != dst.shape:
                raise ValueError(
                    f"local_multi_tensor_scale: pair {i} has source shape {tuple(src.shape)} "
                    f"and destination shape {tuple(dst.shape)}"
                )
            dst.copy_(src * scale)
            finite = finite and bool(torch.isfinite(dst).all())
    if not finite:
        noop_flag.fill_(1)
