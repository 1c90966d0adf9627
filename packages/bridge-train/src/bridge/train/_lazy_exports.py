"""Package attributes that import their module on first use (PEP 562).

``bridge.train`` and ``bridge.train.engine`` export names whose modules import torch and
megatron-core; loading them lazily keeps ``import bridge.train.<light module>`` light (the
command reads its launch environment and its config before it imports torch). The notices
torch and megatron-core print while they are imported this way are held back
(:mod:`bridge.config.notices`) and logged at DEBUG level.
"""

from __future__ import annotations

import ast
import importlib
import logging
from pathlib import Path
from typing import Any

from bridge.config.notices import held_notices, log_held_notices

__all__ = ["lazy_exports", "type_checked_imports"]


def type_checked_imports(init_file: str) -> dict[str, str]:
    """Name -> module of the ``from <module> import <name> as <name>`` statements under
    ``if TYPE_CHECKING:`` in ``init_file``: the names a package exports, said once for the
    type checkers and its lazy lookup alike.

    Args:
        init_file: The package's ``__init__.py`` (its ``__file__``).
    """
    tree = ast.parse(Path(init_file).read_text(encoding="utf-8"))
    return {
        alias.name: node.module
        for block in tree.body
        if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for node in block.body
        if isinstance(node, ast.ImportFrom) and node.module is not None
        for alias in node.names
    }


def lazy_exports(namespace: dict[str, Any]) -> dict[str, str]:
    """Set a package's ``__getattr__`` and ``__dir__`` so that its exports, the
    :func:`type_checked_imports` of its ``__init__.py``, load on first use.

    Args:
        namespace: The package's ``globals()``; a loaded name is stored there, so it is
            looked up only once.

    Returns:
        Exported name -> the module that defines it (the package's ``__all__``).
    """
    package = namespace["__name__"]
    module_of = type_checked_imports(namespace["__file__"])

    def __getattr__(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        # The first name loaded imports torch and megatron-core, which print about 17
        # notices nobody using the API can act on: logged at DEBUG level instead.
        with held_notices() as held:
            value = getattr(importlib.import_module(module), name)
        log_held_notices(held, logging.getLogger(package))
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(module_of))

    namespace.update(__getattr__=__getattr__, __dir__=__dir__)
    return module_of
