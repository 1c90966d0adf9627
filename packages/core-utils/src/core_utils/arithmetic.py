"""Exact integer division for sizes that must split evenly (heads, ranks, batches)."""

from __future__ import annotations

__all__ = ["divide", "ensure_divisibility"]


def ensure_divisibility(numerator: int, denominator: int) -> None:
    """Check that ``numerator`` is divisible by ``denominator``.

    Raises:
        ValueError: ``denominator`` is zero, or the division leaves a remainder; the message
            shows both numbers.
    """
    if denominator == 0:
        raise ValueError(f"cannot divide {numerator} by 0: the denominator must be non-zero")
    if numerator % denominator != 0:
        raise ValueError(
            f"{numerator} is not divisible by {denominator} "
            f"(remainder {numerator % denominator}); choose sizes where {denominator} "
            f"divides {numerator}"
        )


def divide(numerator: int, denominator: int) -> int:
    """Return ``numerator // denominator`` after checking that it divides exactly.

    Raises:
        ValueError: As :func:`ensure_divisibility`.
    """
    ensure_divisibility(numerator, denominator)
    return numerator // denominator
