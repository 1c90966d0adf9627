"""Weight initialisers drawing from a normal distribution."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

__all__ = ["init_method_normal", "scaled_init_method_normal"]


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """Return an in-place initialiser drawing from N(0, sigma).

    Raises:
        ValueError: ``sigma`` is negative.
    """
    if sigma < 0:
        raise ValueError(f"init_method_normal: sigma must be >= 0, got {sigma}")
    return functools.partial(torch.nn.init.normal_, mean=0.0, std=sigma)


def scaled_init_method_normal(
    sigma: float, num_layers: int, multiplier: float = 2.0
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Return an in-place initialiser drawing from N(0, sigma / sqrt(multiplier * num_layers)).

    Used for output projections of residual branches, so the residual stream's variance
    does not grow with depth.

    Raises:
        ValueError: ``sigma`` is negative, or ``num_layers`` / ``multiplier`` not positive.
    """
    if sigma < 0:
        raise ValueError(f"scaled_init_method_normal: sigma must be >= 0, got {sigma}")
    if num_layers <= 0:
        raise ValueError(f"scaled_init_method_normal: num_layers must be > 0, got {num_layers}")
    if multiplier <= 0:
        raise ValueError(f"scaled_init_method_normal: multiplier must be > 0, got {multiplier}")
    std = sigma / math.sqrt(multiplier * num_layers)
    return functools.partial(torch.nn.init.normal_, mean=0.0, std=std)
