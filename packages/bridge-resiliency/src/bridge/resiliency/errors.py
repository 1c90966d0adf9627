"""Errors raised by bridge.resiliency."""

from __future__ import annotations

__all__ = ["MissingExtraError", "ResiliencyError", "missing_nvrx"]

NVRX_INSTALL_HINT = "pip install bridge-resiliency[nvrx]"


class ResiliencyError(RuntimeError):
    """A resiliency feature cannot run as configured (the message says what to change)."""


class MissingExtraError(ImportError):
    """A switched-on feature needs an optional package that is not installed.

    The message names the feature, the missing package and the extra to install.
    """


def missing_nvrx(feature: str, cause: BaseException | None = None) -> MissingExtraError:
    """Build the error for a feature that needs nvidia-resiliency-ext.

    Args:
        feature: The config field or feature that was switched on, e.g.
            ``"ft.enable_ft_package"``.
        cause: The ImportError raised by the import attempt, quoted in the message.

    Returns:
        The error to raise.
    """
    reason = f" ({cause})" if cause is not None else ""
    return MissingExtraError(
        f"{feature} needs nvidia-resiliency-ext, which cannot be imported{reason}. "
        f"Install it with `{NVRX_INSTALL_HINT}` (nvidia-resiliency-ext 0.4.1), or switch "
        f"{feature} off. Note: megatron-core 0.19 refuses nvidia-resiliency-ext < 0.6 in the "
        "same environment; see docs/resiliency.md for what works where."
    )
