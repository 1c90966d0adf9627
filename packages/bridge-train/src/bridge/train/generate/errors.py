"""The error type of generation and evaluation inputs."""

from __future__ import annotations

__all__ = ["GenerationError"]


class GenerationError(ValueError):
    """A checkpoint, prompt or option that generation cannot use.

    The message is one line naming the input (checkpoint directory, prompt, flag) and what to
    do; ``bridge-generate`` prints it and exits with code 2.
    """
