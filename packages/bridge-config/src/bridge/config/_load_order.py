"""The order in which a container's sections are built from YAML data.

A section whose ``_target_`` names a class outside bridge.config (``model:`` with
``bridge.train.models.GPTModelProvider``, ``optimizer:`` with megatron-core's
``OptimizerConfig``) imports that class's package, which for megatron-core takes about ten
seconds. Building every other key first makes a mistake in them (an unknown section, a
misspelt field, a value of the wrong type) an error before anything heavy is imported.
"""

from __future__ import annotations

from typing import Any

from bridge.config._codec import TARGET

_OWN_PREFIX = "bridge.config."


def _needs_import(value: Any) -> bool:
    if not isinstance(value, dict) or TARGET not in value:
        return False
    target = value[TARGET]
    return not (isinstance(target, str) and target.startswith(_OWN_PREFIX))


def sections_needing_no_import_first(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with the sections whose ``_target_`` lies outside bridge.config moved last.

    Args:
        data: Top-level mapping of a config (section name -> section data).

    Returns:
        A new mapping with the same items; relative order is kept within each group.
    """
    light = {key: value for key, value in data.items() if not _needs_import(value)}
    heavy = {key: value for key, value in data.items() if _needs_import(value)}
    return {**light, **heavy}
