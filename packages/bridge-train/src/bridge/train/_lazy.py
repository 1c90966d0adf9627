"""Package attributes imported on first use (PEP 562), so importing a package stays light."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(
    package: str, module_of: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` for names that live in other modules.

    Args:
        package: The package's ``__name__`` (for the error message).
        module_of: Public name -> module that defines it.
        namespace: The package's ``globals()``; a name is cached there once imported.

    Returns:
        ``(__getattr__, __dir__)`` to assign at the package's top level.
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
