"""Package attributes that import their module on first use (PEP 562).

``bridge.train`` and ``bridge.train.engine`` export names whose modules import torch and
megatron-core; loading them lazily keeps ``import bridge.train.<light module>`` light (the
command reads its launch environment and its config before it imports torch).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, module_of: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for a package whose names load from ``module_of`` on use.

    Args:
        package: The package's ``__name__`` (for the error message).
        module_of: Exported name -> the module that defines it.
        namespace: The package's ``globals()``; a loaded name is stored there, so it is
            looked up only once.

    Returns:
        The two module-level functions to assign in the package's ``__init__``.
    """

    def __getattr__(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(module_of))

    return __getattr__, __dir__
