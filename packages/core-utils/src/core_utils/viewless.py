"""Viewless tensors: tensors that do not keep the tensor they were viewed from alive.

A view holds its base tensor through ``._base``; setting ``view.data`` later frees nothing,
so a view stored across iterations (pipeline activations, checkpoint buffers) leaks the
whole base. A viewless tensor shares the same data but has ``._base`` unset.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "MakeViewlessTensor",
    "assert_viewless_tensor",
    "make_viewless_tensor",
    "safely_set_viewless_tensor_data",
]


def _kernel_make_viewless_tensor(inp: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """Return a tensor sharing ``inp``'s data without a link to ``inp``'s base."""
    out = torch.empty((1,), dtype=inp.dtype, device=inp.device, requires_grad=requires_grad)
    out.data = inp.data
    return out


class MakeViewlessTensor(torch.autograd.Function):
    """Autograd function making a viewless tensor while keeping the graph.

    Use through :func:`make_viewless_tensor` with ``keep_graph=True``; the backward pass
    hands the gradient through unchanged.
    """

    @staticmethod
    def forward(ctx: Any, inp: torch.Tensor, requires_grad: bool) -> torch.Tensor:
        """Return the viewless tensor."""
        return _kernel_make_viewless_tensor(inp, requires_grad)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        """Pass the gradient through."""
        return grad_output, None


def make_viewless_tensor(inp: torch.Tensor, requires_grad: bool, keep_graph: bool) -> torch.Tensor:
    """Return ``inp`` itself if it is not a view, else a viewless tensor with its data.

    Args:
        inp: Tensor, possibly a view.
        requires_grad: ``requires_grad`` of the new tensor.
        keep_graph: Keep the autograd graph (through :class:`MakeViewlessTensor`); otherwise
            the new tensor is a leaf.
    """
    if inp._base is None:
        return inp
    if keep_graph:
        result: torch.Tensor = MakeViewlessTensor.apply(inp, requires_grad)
        return result
    return _kernel_make_viewless_tensor(inp, requires_grad)


def assert_viewless_tensor(tensor: Any, extra_msg: str | None = None) -> Any:
    """Check that a tensor (or each tensor of a list) is not a view; return it unchanged.

    Non-tensor values pass through unchecked.

    Raises:
        ValueError: The tensor is a view (its ``._base`` is set).
    """
    if isinstance(tensor, list):
        for item in tensor:
            assert_viewless_tensor(item, extra_msg)
        return tensor
    if not isinstance(tensor, torch.Tensor):
        return tensor
    if tensor._base is not None:
        raise ValueError(
            f"expected a viewless tensor, got a view of shape {tuple(tensor.shape)} of a base "
            f"tensor of shape {tuple(tensor._base.shape)}; setting .data on a view or storing "
            "it keeps the whole base alive (a memory leak that grows every iteration). Make it "
            f"viewless first with make_viewless_tensor(...).{' ' + extra_msg if extra_msg else ''}"
        )
    return tensor


def safely_set_viewless_tensor_data(tensor: torch.Tensor, new_data_tensor: torch.Tensor) -> None:
    """Set ``tensor.data = new_data_tensor`` after checking that ``tensor`` is not a view.

    Raises:
        ValueError: ``tensor`` is a view.
    """
    assert_viewless_tensor(
        tensor,
        extra_msg=f"(new_data_tensor has shape {tuple(new_data_tensor.shape)})",
    )
    tensor.data = new_data_tensor
