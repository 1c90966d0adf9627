"""The error raised for every checkpoint problem a user can fix."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded as configured.

    The message names the directory or key involved, what was found, and how to fix it.
    Raised consistently on every rank, so a distributed job fails instead of hanging.
    """
