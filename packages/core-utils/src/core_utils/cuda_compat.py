"""A scoped compatibility layer that lets CUDA-assuming code run on a CPU-only machine.

Why it exists
    Parts of megatron-core (dist_checkpointing save, its ``Timers``) and of code built on
    it (communicators that create ``backend="nccl"`` groups) call CUDA-only functions even
    when every tensor involved lives on the CPU: ``torch.cuda.synchronize()`` to wait for
    kernels that cannot exist, ``torch.cuda.current_device()`` to place a tiny flag tensor,
    and ``nccl`` as a hard-coded backend. Without CUDA each of those raises, although the
    computation itself runs fine on CPU with gloo.

What it patches (only inside ``with cpu_cuda_compat():``)
    * ``torch.cuda.synchronize`` becomes a no-op (there is no device to wait for);
    * ``torch.cuda.current_device`` returns ``torch.device("cpu")``, so tensors "placed on
      the current device" land on the CPU;
    * process groups requested with an ``nccl`` backend (``"nccl"``, ``"cuda:nccl"``,
      ``"cpu:gloo,cuda:nccl"``, ``Backend.NCCL``...) are created with ``gloo`` instead, and
      nccl-specific ``pg_options`` and CUDA ``device_id`` arguments are dropped. This covers
      ``torch.distributed.init_process_group``, ``torch.distributed.new_group`` and every
      torch helper built on it (``new_subgroups``, ``new_subgroups_by_enumeration``, used by
      megatron-core's ``HyperCommGrid.create_pg`` and ``parallel_state``), because the
      internal group constructor is patched as well as the public names.

When it applies
    Only when ``torch.cuda.is_available()`` is false at the outermost entry. With a GPU the
    context manager does nothing, so the same code path uses real CUDA and nccl there.

Scope and threads
    Patches are process-global (they replace module attributes) and last from the outermost
    ``__enter__`` to the matching ``__exit__``; nesting is counted, so inner uses neither
    re-patch nor undo early. The counter is lock-protected, so a background thread (e.g. an
    async checkpoint saver) may enter the context itself to keep the patches alive until it
    finishes, even if the thread that started it has left. Code that bound a patched function
    to a local name before the context started (``from torch.cuda import synchronize``) keeps
    the original; code that calls ``torch.cuda.synchronize()`` sees the patch.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["cpu_cuda_compat", "cuda_compat_active", "gloo_backend_for"]

_lock = threading.RLock()
_depth = 0
_active = False
_saved: list[tuple[ModuleType, str, Any]] = []


def gloo_backend_for(backend: Any) -> Any:
    """Return ``"gloo"`` for a backend spec that asks for nccl, else ``backend`` unchanged.

    Args:
        backend: A backend name, ``torch.distributed.Backend`` or device-mapped spec such as
            ``"cpu:gloo,cuda:nccl"``; ``None`` stays ``None``.
    """
    if backend is None:
        return None
    return "gloo" if "nccl" in str(backend).lower() else backend


def _is_cuda_device(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True  # an int device index means a CUDA device
    return torch.device(device).type == "cuda"


def _rewrite_group_call(
    original: Callable[..., Any], options_params: tuple[str, ...]
) -> Callable[..., Any]:
    """Wrap a group constructor so nccl requests become gloo requests."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind_partial(*args, **kwargs)
        requested = bound.arguments.get("backend")
        replaced = gloo_backend_for(requested)
        if replaced is not requested:
            bound.arguments["backend"] = replaced
            for name in options_params:
                # nccl options objects are meaningless (and rejected) for gloo.
                if name in bound.arguments:
                    bound.arguments[name] = None
        if _is_cuda_device(bound.arguments.get("device_id")):
            bound.arguments["device_id"] = None
        return original(*bound.args, **bound.kwargs)

    wrapper.__cuda_compat_original__ = original  # type: ignore[attr-defined]
    return wrapper


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _no_synchronize(device: Any = None) -> None:
    return None


def _patches() -> list[tuple[ModuleType, str, Any]]:
    c10d = dist.distributed_c10d
    patches: list[tuple[ModuleType, str, Any]] = [
        (torch.cuda, "synchronize", _no_synchronize),
        (torch.cuda, "current_device", _cpu_current_device),
    ]
    init_pg = _rewrite_group_call(c10d.init_process_group, ("pg_options",))
    new_group = _rewrite_group_call(c10d.new_group, ("pg_options",))
    patches += [
        (dist, "init_process_group", init_pg),
        (c10d, "init_process_group", init_pg),
        (dist, "new_group", new_group),
        (c10d, "new_group", new_group),
    ]
    # torch's own subgroup helpers call this internal constructor directly.
    if hasattr(c10d, "_new_group_with_tag"):
        patches.append(
            (
                c10d,
                "_new_group_with_tag",
                _rewrite_group_call(c10d._new_group_with_tag, ("backend_options",)),
            )
        )
    return patches


def _install() -> None:
    global _active
    for module, name, replacement in _patches():
        _saved.append((module, name, getattr(module, name)))
        setattr(module, name, replacement)
    _active = True


def _uninstall() -> None:
    global _active
    while _saved:
        module, name, original = _saved.pop()
        setattr(module, name, original)
    _active = False


def cuda_compat_active() -> bool:
    """Return whether the CPU compatibility patches are currently installed."""
    return _active


@contextlib.contextmanager
def cpu_cuda_compat() -> Iterator[bool]:
    """Run the body with the CPU compatibility patches when CUDA is absent.

    See the module docstring for what is patched. Re-entrant and safe to enter from
    several threads; the patches are removed when the outermost use exits.

    Yields:
        ``True`` when the patches are active, ``False`` when CUDA is available and the
        context does nothing.
    """
    global _depth
    with _lock:
        if _depth == 0 and not torch.cuda.is_available():
            _install()
        _depth += 1
        active = _active
    try:
        yield active
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _active:
                _uninstall()
