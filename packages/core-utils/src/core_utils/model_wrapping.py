"""Reach through model wrappers (DDP, FSDP, Float16Module, ...) to the model inside."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

import torch

__all__ = [
    "ModelOrChunks",
    "get_attr_wrapped_model",
    "get_model_config",
    "get_model_type",
    "get_model_xattn",
    "is_submodule",
    "unwrap_model",
]

#: A model, or its chunks (one per virtual pipeline stage), wrapped or not.
ModelOrChunks = torch.nn.Module | Sequence[torch.nn.Module]

# megatron-core wrapper classes recognised by name, so that this module never imports
# megatron-core: (defining-module prefix, class name).
_MEGATRON_WRAPPERS = frozenset(
    {
        ("megatron.core.distributed", "DistributedDataParallel"),
        ("megatron.core.distributed", "TorchFullyShardedDataParallel"),
        ("megatron.core.distributed", "FullyShardedDataParallel"),
        ("megatron.core.transformer.module", "Float16Module"),
    }
)


def get_attr_wrapped_model(
    model: torch.nn.Module, attr: str, allow_none: bool = True, return_model_obj: bool = False
) -> Any:
    """Get ``attr`` from a model, looking through ``.module`` wrappers until one has it.

    Args:
        model: A model, possibly wrapped (each wrapper exposes the inner model as ``.module``).
        attr: Attribute name.
        allow_none: Accept an attribute whose value is ``None``; when False, keep unwrapping
            past wrappers on which it is ``None``.
        return_model_obj: Return the (inner) object holding ``attr`` instead of its value.

    Returns:
        The attribute value, or the object that holds it.

    Raises:
        RuntimeError: ``model`` is a list (pass one model chunk), or no wrapper level has
            ``attr`` (RuntimeError for both, as in megatron-core, so existing
            ``except RuntimeError`` callers keep working).
    """
    if isinstance(model, list):
        raise RuntimeError(
            f"get_attr_wrapped_model expects one model, got a list of {len(model)}; "
            "pass a single model chunk (e.g. model[0])"
        )
    current: Any = model

    def missing(obj: Any) -> bool:
        if allow_none:
            return not hasattr(obj, attr)
        return getattr(obj, attr, None) is None

    while missing(current):
        if not hasattr(current, "module"):
            raise RuntimeError(
                f"get_attr_wrapped_model: no attribute {attr!r}"
                f"{'' if allow_none else ' (that is not None)'} on {type(model).__name__} "
                "or any model it wraps"
            )
        current = current.module
    return current if return_model_obj else getattr(current, attr)


def get_model_type(model: torch.nn.Module) -> Any:
    """Return the ``model_type`` attribute of a (wrapped) model."""
    return get_attr_wrapped_model(model, "model_type")


def get_model_xattn(model: torch.nn.Module) -> bool:
    """Return the (wrapped) model's ``xattn_needed`` attribute; ``False`` if it has none."""
    try:
        return bool(get_attr_wrapped_model(model, "xattn_needed"))
    except RuntimeError:
        return False


def get_model_config(model: torch.nn.Module) -> Any:
    """Return the first non-None ``config`` attribute of a (wrapped) model.

    Raises:
        RuntimeError: No level of the model has a non-None ``config``.
    """
    return get_attr_wrapped_model(model, "config", allow_none=False)


def _is_default_wrapper(obj: Any) -> bool:
    if isinstance(obj, torch.nn.parallel.DistributedDataParallel):
        return True
    for klass in type(obj).__mro__:
        if klass.__name__ == "FullyShardedDataParallel" and klass.__module__.startswith(
            "torch.distributed.fsdp"
        ):
            return True
        if any(
            klass.__module__.startswith(prefix) and klass.__name__ == name
            for prefix, name in _MEGATRON_WRAPPERS
        ):
            return True
    return False


@overload
def unwrap_model(model: list[torch.nn.Module], module_instances: Any = None) -> list[Any]: ...
@overload
def unwrap_model(model: torch.nn.Module, module_instances: Any = None) -> Any: ...
def unwrap_model(model: ModelOrChunks, module_instances: Any = None) -> Any:
    """Strip wrapper modules and return the model inside.

    Args:
        model: A model or a list of model chunks.
        module_instances: Wrapper class or tuple of classes to strip. ``None`` strips
            torch ``DistributedDataParallel`` and FSDP, and megatron-core's
            ``DistributedDataParallel``, ``TorchFullyShardedDataParallel``,
            ``FullyShardedDataParallel`` and ``Float16Module`` (recognised by class name and
            module, without importing megatron-core).

    Returns:
        The unwrapped model, or a list of them when given a list.
    """

    def is_wrapper(obj: Any) -> bool:
        if module_instances is None:
            return _is_default_wrapper(obj)
        return isinstance(obj, module_instances)

    def unwrap_one(obj: Any) -> Any:
        while is_wrapper(obj):
            obj = obj.module
        return obj

    if isinstance(model, list):
        return [unwrap_one(chunk) for chunk in model]
    return unwrap_one(model)


def is_submodule(
    module: torch.nn.Module, parent_module: torch.nn.Module, strict: bool = True
) -> bool:
    """Return whether ``module`` is ``parent_module`` or one of its descendants.

    Args:
        module: The candidate submodule.
        parent_module: The module to search.
        strict: If True, a module is not a submodule of itself.
    """
    if strict and module is parent_module:
        return False
    return any(candidate is module for candidate in parent_module.modules())
