"""Small tensor helpers: an unwrap-once tensor handle and optional concatenation."""

from __future__ import annotations

import torch

__all__ = ["WrappedTensor", "maybe_cat"]


class WrappedTensor:
    """An indirect reference to a tensor that the receiver takes exactly once.

    The caller wraps a tensor and drops its own reference; the callee calls :meth:`unwrap`,
    after which the wrapper no longer holds the tensor, so it can be freed as soon as the
    callee is done with it.

    Args:
        tensor: The tensor to hand over.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self._wrapper: list[torch.Tensor] = [tensor]

    def unwrap(self) -> torch.Tensor:
        """Return the tensor and drop the wrapper's reference to it.

        Raises:
            RuntimeError: The tensor was already unwrapped.
        """
        if not self._wrapper:
            raise RuntimeError(
                "WrappedTensor has already been unwrapped; unwrap() may be called only once "
                "(keep the tensor it returned the first time)"
            )
        return self._wrapper.pop()


def maybe_cat(
    a: torch.Tensor | None, b: torch.Tensor | None, dim: int = 0, *, required: bool = False
) -> torch.Tensor | None:
    """Concatenate ``a`` and ``b`` along ``dim``, skipping whichever is ``None``.

    Args:
        a: First tensor or ``None``.
        b: Second tensor or ``None``.
        dim: Dimension to concatenate along.
        required: Raise instead of returning ``None`` when both are ``None``.

    Returns:
        ``cat([a, b])``, the one that is not ``None``, or ``None``.

    Raises:
        ValueError: Both are ``None`` and ``required`` is set.
    """
    present = [t for t in (a, b) if t is not None]
    if not present:
        if required:
            raise ValueError("maybe_cat(required=True): both a and b are None")
        return None
    if len(present) == 1:
        return present[0]
    return torch.cat(present, dim=dim)
