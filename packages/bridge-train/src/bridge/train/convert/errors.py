"""The error every conversion problem a user can fix is raised as (defined with the families,
which raise it too)."""

from __future__ import annotations

from bridge.train.models.families.errors import ConversionError

__all__ = ["ConversionError"]
