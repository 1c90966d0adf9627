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
    finishes, even if the thread that started it has left. Modules that bound a patched
    function under its own name (``from torch.cuda import synchronize``) are rebound for the
    scope too, and set back on exit; a binding under another name keeps the original.

Wider scope
    :mod:`core_utils.cuda_emulation` builds on these patches (same machinery) to run
    megatron-core's DDP, optimizers and pipeline schedules on CPU.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from types import BuiltinFunctionType, FunctionType, ModuleType
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["cpu_cuda_compat", "cuda_compat_active", "gloo_backend_for"]

_lock = threading.RLock()

# Modules whose own references to the originals must never be rewritten by the rebinding scan.
# Only plain functions are rebound elsewhere (a class rebound would break isinstance checks).
_FUNCTION_TYPES = (FunctionType, BuiltinFunctionType)
_NEVER_REBIND = ("core_utils.cuda_compat", "core_utils.cuda_emulation")


class _ScopedPatchSet:
    """A set of attribute patches installed by the outermost scope entry, undone by its exit.

    One implementation for every CPU compatibility scope in core-utils (this module's
    :func:`cpu_cuda_compat` and :func:`core_utils.cuda_emulation.cuda_emulation`).

    ``build`` returns ``(owner, name, replacement)`` triples. For each triple whose owner is a
    module, other modules that bound the same original function to a name of their own
    (``from torch.cuda import synchronize``, megatron's ``from torch.cuda import _lazy_call``)
    under the same name are rebound too, and on exit any module that imported a replacement
    while the scope was open is set back to the original: nothing outlives the scope.

    Args:
        build: Returns the patches (called at each outermost entry).
        requires: A patch set entered (counted) around this one.
        on_install: Called after installing, under the lock.
        on_uninstall: Called after uninstalling, under the lock.
    """

    def __init__(
        self,
        build: Callable[[], list[tuple[Any, str, Any]]],
        *,
        requires: _ScopedPatchSet | None = None,
        on_install: Callable[[], None] | None = None,
        on_uninstall: Callable[[], None] | None = None,
    ) -> None:
        self._build = build
        self._requires = requires
        self._on_install = on_install
        self._on_uninstall = on_uninstall
        self._depth = 0
        self._saved: list[tuple[Any, str, Any]] = []
        self._rebound: dict[str, list[tuple[Any, Any]]] = {}
        self.active = False

    @contextlib.contextmanager
    def scope(self) -> Iterator[bool]:
        """Enter the patch set (counted); yields whether it is active (False with CUDA)."""
        with contextlib.ExitStack() as stack:
            if self._requires is not None:
                stack.enter_context(self._requires.scope())
            with _lock:
                if self._depth == 0 and not torch.cuda.is_available():
                    self._install()
                self._depth += 1
                active = self.active
            try:
                yield active
            finally:
                with _lock:
                    self._depth -= 1
                    if self._depth == 0 and self.active:
                        self._uninstall()

    def _install(self) -> None:
        # name -> [(original, replacement)]: other modules' bindings under the same name.
        rebind: dict[str, list[tuple[Any, Any]]] = {}
        for owner, name, replacement in self._build():
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, replacement)
            if isinstance(owner, ModuleType) and isinstance(original, _FUNCTION_TYPES):
                rebind.setdefault(name, []).append((original, replacement))
        for module in _scannable_modules():
            namespace = vars(module)
            for name, pairs in rebind.items():
                value = namespace.get(name)
                for original, replacement in pairs:
                    if value is original:
                        self._saved.append((module, name, original))
                        setattr(module, name, replacement)
        self._rebound = {name: [(new, old) for old, new in pairs] for name, pairs in rebind.items()}
        self.active = True
        if self._on_install is not None:
            self._on_install()

    def _uninstall(self) -> None:
        while self._saved:
            owner, name, original = self._saved.pop()
            setattr(owner, name, original)
        # Modules imported inside the scope bound a replacement: give them the original.
        for module in _scannable_modules():
            namespace = vars(module)
            for name, pairs in self._rebound.items():
                value = namespace.get(name)
                for replacement, original in pairs:
                    if value is replacement:
                        setattr(module, name, original)
        self._rebound = {}
        self.active = False
        if self._on_uninstall is not None:
            self._on_uninstall()


def _scannable_modules() -> list[ModuleType]:
    return [
        module
        for name, module in list(sys.modules.items())
        if isinstance(module, ModuleType) and not name.startswith(_NEVER_REBIND)
    ]


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


def _patches() -> list[tuple[Any, str, Any]]:
    c10d = dist.distributed_c10d
    patches: list[tuple[Any, str, Any]] = [
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


_COMPAT = _ScopedPatchSet(_patches)


def cuda_compat_active() -> bool:
    """Return whether the CPU compatibility patches are currently installed."""
    return _COMPAT.active


@contextlib.contextmanager
def cpu_cuda_compat() -> Iterator[bool]:
    """Run the body with the CPU compatibility patches when CUDA is absent.

    See the module docstring for what is patched. Re-entrant and safe to enter from
    several threads; the patches are removed when the outermost use exits.

    Yields:
        ``True`` when the patches are active, ``False`` when CUDA is available and the
        context does nothing.
    """
    with _COMPAT.scope() as active:
        yield active
