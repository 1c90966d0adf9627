"""The error every Hugging Face conversion problem a user can fix is raised as."""

from __future__ import annotations

__all__ = ["ConversionError"]


class ConversionError(ValueError):
    """A Hugging Face checkpoint or a bridge-train checkpoint that cannot be converted.

    The message is one line naming the file, field or tensor and what to do about it;
    ``bridge-convert`` prints it and exits with code 2. (Also importable as
    ``bridge.train.convert.ConversionError``.)
    """
