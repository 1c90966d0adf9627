"""Lazy access to megatron-core, which core-utils never imports at load time."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

__all__ = ["import_megatron", "initialized_parallel_state"]

INSTALL_HINT = "install it with `pip install megatron-core`"


def import_megatron(module: str, needed_by: str) -> ModuleType:
    """Import a megatron-core module, or raise an error saying who needs it.

    Args:
        module: Dotted module name, e.g. ``"megatron.core.parallel_state"``.
        needed_by: What needs it, for the message (e.g. ``"make_sharded_tensor_for_checkpoint"``).

    Raises:
        ImportError: megatron-core is not installed (or the module does not exist in the
            installed version).
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{needed_by} needs megatron-core ({module} could not be imported: {exc}); "
            f"{INSTALL_HINT}"
        ) from exc


def initialized_parallel_state() -> ModuleType | None:
    """Return megatron's ``parallel_state`` if its model-parallel groups are initialised.

    Never imports megatron-core: groups can only have been initialised by code that already
    imported ``megatron.core.parallel_state``, so a module that is not loaded means "not
    initialised".
    """
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None:
        return None
    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state
