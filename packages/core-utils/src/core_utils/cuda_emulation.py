"""CUDA emulation: run megatron-core's CUDA-assuming training machinery on a CPU-only machine.

Why it exists
    megatron-core's ``DistributedDataParallel``, ``get_megatron_optimizer`` (FP32, mixed
    precision and distributed optimizer), pipeline schedules and RNG tracker compute nothing
    that needs a GPU, but they place tensors with ``device="cuda"``, check type strings such
    as ``'torch.cuda.FloatTensor'``, order work with CUDA streams and events and save/restore
    the CUDA RNG. :func:`cuda_emulation` redirects each of those to the CPU for the length of
    a scope, with no change to megatron-core's source and ``torch.cuda.is_available()`` still
    ``False``, so the same code path that runs on GPUs runs (over gloo) on a laptop or in CI.

What it covers (inside ``with cuda_emulation():``)
    * everything :func:`core_utils.cpu_cuda_compat` does (it is entered too): ``nccl``
      process groups created as ``gloo``, ``torch.cuda.synchronize`` a no-op,
      ``torch.cuda.current_device()`` giving ``torch.device("cpu")``;
    * a :class:`torch.overrides.TorchFunctionMode` that rewrites CUDA devices (``"cuda"``,
      ``"cuda:N"``, ``torch.device("cuda")``, an ``int`` index) to ``cpu`` in every torch
      call's ``device=`` argument and in ``Tensor.to``; makes ``Tensor.cuda()`` (also
      ``module.cuda()``, ``weight.data.cuda()``) and ``Tensor.pin_memory()`` return the
      tensor; and makes ``Tensor.type()`` report CUDA
      type names (``'torch.cuda.FloatTensor'``) for CPU tensors, as megatron's optimizers
      assert them (``Tensor.type('torch.cuda.HalfTensor')`` converts to the CPU type);
    * ``torch.distributed.all_to_all_single`` takes tensor split sizes (megatron's MoE
      alltoall dispatcher makes them numpy arrays only for CUDA tensors);
    * streams and events: ``torch.cuda.Stream``, ``Event``, ``current_stream``,
      ``default_stream``, the ``torch.cuda.stream(...)`` context and
      ``Tensor.record_stream`` on an emulated stream (a no-op). CPU kernels run in
      issue order on the calling thread, so every stream/event wait is already satisfied;
    * the CUDA RNG is the CPU generator: ``torch.cuda.get_rng_state`` / ``set_rng_state``
      (and ``_all``), ``manual_seed`` / ``manual_seed_all``, ``seed``, ``initial_seed`` and
      ``torch.cuda.default_generators[i]`` all act on ``torch.default_generator``. Seeding
      "the CUDA RNG" therefore reseeds the CPU RNG (on a GPU they are separate streams);
    * ``torch.cuda._lazy_call`` runs its callback at once, and so does every module's own
      binding of it (megatron's ``tensor_parallel/random.py`` imports it at load time).
      Without this, torch queues the callbacks until a CUDA initialisation that never
      comes, and megatron's ``CudaRNGStatesTracker.fork()`` silently leaves the generator on
      the model-parallel seed instead of restoring it (silent trap 1). The warning megatron
      logs when "the CPU RNG changed inside a GPU RNG context" is dropped in the scope: the
      two are the same generator here, so it is always true and meaningless;
    * modules that bound one of the patched functions to a name of their own
      (``from torch.cuda import synchronize``) are rebound for the scope and set back after.

What fails loudly instead (:class:`CudaEmulationError`, naming the call and its caller)
    * any other ``torch.cuda`` function that needs a device (``get_device_properties``,
      ``memory_allocated`` after initialisation, ``set_device``-free paths through
      ``_lazy_init``...): the error says which function, called from where;
    * ``torch.autocast("cuda", enabled=True)`` (megatron's ``enable_autocast``) and
      ``torch.cuda.amp.autocast``: without a GPU torch would only warn and run without
      autocast, silently changing the numerics. CPU autocast has different op lists, so
      it is refused rather than substituted; megatron's bf16/fp16 path (``Float16Module``
      and the mixed-precision optimizer) needs no autocast and runs;
    * a thread covered by the emulation (below) that reaches a CUDA device after the scope
      has ended;
    * a CUDA device requested inside autograd's backward pass (a custom
      ``autograd.Function.backward`` or a gradient hook): torch does not carry
      TorchFunctionModes into the autograd engine, so the device rewriting does not apply
      there. The process-wide patches (streams, RNG, ``current_device``...) do.

What it cannot cover
    CUDA kernels (Transformer Engine, Apex, fused/Triton kernels, flash attention), CUDA
    graphs, fp8, races between streams (CPU work is serialised, so a missing stream wait
    in megatron cannot show up here), NCCL-specific behaviour (user buffers, SHARP,
    symmetric memory), and ``torch.cuda.is_available()`` itself, which stays ``False`` so
    code that checks it takes its CPU branch. Tensors stay CPU tensors: ``Tensor.is_cuda``
    and ``Tensor.device`` tell the truth.

Threads (silent trap 2)
    A TorchFunctionMode applies only to the thread that pushed it. Threads **started**
    (``threading.Thread.start``) while the emulation is active run their whole target under
    the device-rewriting mode too, so ``device="cuda"`` in a background thread behaves as on
    the main thread. Such a thread does not keep the scope alive: once the outermost scope
    has exited, its next CUDA device request raises :class:`CudaEmulationError` rather
    than silently landing anywhere. Threads that were already running when the scope was
    entered are not covered: their ``device="cuda"`` raises :class:`CudaEmulationError`
    while the scope is open (torch's own no-GPU error outside it).

Scope
    Re-entrant and counted like :func:`~core_utils.cpu_cuda_compat`: the outermost entry
    installs the process-wide patches, the matching exit restores every original attribute;
    the device-rewriting mode is pushed once per thread. Active only when
    ``torch.cuda.is_available()`` is ``False`` at the outermost entry; with a GPU the scope
    does nothing. :func:`without_device_rewriting` suspends the mode for a block that names
    no CUDA device (its cost: every torch call of the thread dispatches into it); a CUDA
    device named inside such a block fails loudly.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from core_utils.cuda_compat import _COMPAT, _ScopedPatchSet

__all__ = [
    "CudaEmulationError",
    "cuda_emulation",
    "cuda_emulation_active",
    "without_device_rewriting",
]

_CPU = torch.device("cpu")
_thread_state = threading.local()


class CudaEmulationError(RuntimeError):
    """megatron-core (or other code) reached CUDA in a way the emulation does not cover."""


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    # An int device index means a CUDA device (bool is an int, but never a device).
    return isinstance(device, int) and not isinstance(device, bool)


def _require_scope(what: str) -> None:
    if not _EMULATION.active:
        raise CudaEmulationError(
            f"{what} after the CUDA emulation scope ended (a thread started inside "
            "core_utils.cuda_emulation() outlived it); keep the scope open until the "
            "thread finishes"
        )


# -- the device-rewriting mode ----------------------------------------------------------


def _tensor_cuda(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    _require_scope("Tensor.cuda()")
    return args[0]


def _tensor_pin_memory(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0]


def _cpu_type_name(name: Any) -> Any:
    if isinstance(name, type) and name.__module__ == "torch.cuda":
        return f"torch.{name.__name__}"
    if isinstance(name, str) and name.startswith("torch.cuda."):
        return "torch." + name[len("torch.cuda.") :]
    return name


def _tensor_type(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if len(args) > 1 or kwargs.get("dtype") is not None:
        # A conversion: a requested CUDA tensor type becomes the CPU type of the same dtype.
        if len(args) > 1:
            args = (args[0], _cpu_type_name(args[1]), *args[2:])
        else:
            kwargs = {**kwargs, "dtype": _cpu_type_name(kwargs["dtype"])}
        return func(*args, **kwargs)
    name = func(*args, **kwargs)
    if args[0].device.type == "cpu" and name.startswith("torch."):
        return "torch.cuda." + name[len("torch.") :]
    return name


def _tensor_to(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if any(
        isinstance(a, (str, torch.device, int)) and _is_cuda_device(a) for a in args[1:]
    ) or _is_cuda_device(kwargs.get("device")):
        _require_scope("Tensor.to('cuda')")
        args = tuple(
            _CPU if isinstance(a, (str, torch.device, int)) and _is_cuda_device(a) else a
            for a in args
        )
        if _is_cuda_device(kwargs.get("device")):
            kwargs = {**kwargs, "device": _CPU}
    return func(*args, **kwargs)


def _all_to_all_single(original: Callable[..., Any]) -> Callable[..., Any]:
    # megatron's MoE alltoall dispatcher turns its split sizes into numpy arrays only when
    # they are CUDA tensors (moe_utils.maybe_move_tensor_to_cpu checks is_cuda); CPU tensors
    # stay tensors, which the process group's all_to_all_single rejects. A process-wide patch,
    # not a mode handler: megatron also calls it from autograd backward, where no
    # TorchFunctionMode is active.
    @functools.wraps(original)
    def all_to_all_single(
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Any = None,
        input_split_sizes: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if isinstance(output_split_sizes, torch.Tensor):
            output_split_sizes = output_split_sizes.tolist()
        if isinstance(input_split_sizes, torch.Tensor):
            input_split_sizes = input_split_sizes.tolist()
        return original(output, input, output_split_sizes, input_split_sizes, *args, **kwargs)

    return all_to_all_single


_HANDLERS: dict[Any, Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]] = {
    torch.Tensor.cuda: _tensor_cuda,
    torch.Tensor.pin_memory: _tensor_pin_memory,
    torch.Tensor.type: _tensor_type,
    torch.Tensor.to: _tensor_to,
}


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA devices to the CPU in the calling thread's torch calls.

    Every torch call of the thread passes through here (ops, tensor methods, property reads,
    grad-mode switches: ~3,000 per training step of a small GPT), so the common case comes
    first: a call without keyword arguments has no ``device=`` to rewrite and, unless it is
    one of the :data:`_HANDLERS` methods (whose device may be positional), runs as it is.
    """

    def __torch_function__(
        self,
        func: Any,
        types: Iterable[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        handler = _HANDLERS.get(func)
        if not kwargs:
            if handler is None:
                return func(*args)
            return handler(func, args, {})
        if handler is not None:
            return handler(func, args, kwargs)
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device):
            _require_scope(f"device={device!r} in {getattr(func, '__name__', func)}")
            kwargs = {**kwargs, "device": _CPU}
        return func(*args, **kwargs)


@contextlib.contextmanager
def _thread_mode() -> Iterator[None]:
    """Push the device-rewriting mode once per thread (nested entries reuse it).

    A scope opened inside :func:`without_device_rewriting` asked for the emulation, so it
    gets the mode back for its body.
    """
    depth = getattr(_thread_state, "depth", 0)
    if depth:
        suspended = getattr(_thread_state, "suspended", None)
        _thread_state.depth = depth + 1
        _thread_state.suspended = None
        try:
            if suspended is None:
                yield
            else:
                with suspended:
                    yield
        finally:
            _thread_state.depth -= 1
            _thread_state.suspended = suspended
        return
    mode = _CudaToCpuMode()
    _thread_state.depth = 1
    _thread_state.mode = mode
    _thread_state.suspended = None
    with mode:
        try:
            yield
        finally:
            _thread_state.depth = 0
            _thread_state.mode = None


@contextlib.contextmanager
def without_device_rewriting() -> Iterator[bool]:
    """Run the body without the device-rewriting mode, for code that asks for no CUDA device.

    Every torch call of a thread under the emulation pays torch's dispatch into the Python
    mode (~4-5 us a call on a 2-core machine; hundreds of calls per forward of a small
    model). Code that places nothing on ``"cuda"`` by name needs none of it: megatron's
    ``torch.cuda.current_device()`` is already the CPU (a process-wide patch, which stays),
    as are streams, events, the CUDA RNG and autocast. Inside this block:

    * a literal CUDA device (``device="cuda"``, ``"cuda:N"``, an ``int`` index,
      ``Tensor.cuda()``, ``Tensor.to("cuda")``) is not rewritten: it reaches torch, whose
      CUDA initialisation raises :class:`CudaEmulationError` naming the line and this block
      (``pin_memory()`` raises torch's own no-driver error). Nothing lands silently
      elsewhere;
    * ``Tensor.type()`` reports the tensor's real (CPU) type name, as outside the emulation:
      megatron's optimizers, which check CUDA type names, must not run here;
    * a :func:`cuda_emulation` scope opened inside gets the mode back for its body.

    It is a no-op (the body runs under the mode, only slower) when this thread has no
    device-rewriting mode (a GPU, or no emulation scope), when another
    ``TorchFunctionMode`` was pushed above it (a profiler's or counter's: popping ours from
    under it would reorder the stack), or inside another such block.

    Yields:
        ``True`` when the mode is suspended for the body, ``False`` when the block changes
        nothing.
    """
    mode = getattr(_thread_state, "mode", None)
    if (
        mode is None
        or getattr(_thread_state, "suspended", None) is not None
        or torch._C._len_torch_function_stack() == 0
        or torch._C._get_function_stack_at(torch._C._len_torch_function_stack() - 1) is not mode
    ):
        yield False
        return
    torch._C._pop_torch_function_stack()
    _thread_state.suspended = _Resumed(mode)
    try:
        yield True
    finally:
        _thread_state.suspended = None
        torch._C._push_on_torch_function_stack(mode)


class _Resumed:
    """The mode pushed again for a :func:`cuda_emulation` scope nested in a suspension."""

    def __init__(self, mode: _CudaToCpuMode) -> None:
        self.mode = mode

    def __enter__(self) -> None:
        torch._C._push_on_torch_function_stack(self.mode)

    def __exit__(self, *exc: object) -> None:
        torch._C._pop_torch_function_stack()


def _device_rewriting_suspended() -> bool:
    return getattr(_thread_state, "suspended", None) is not None


# -- streams, events, RNG ---------------------------------------------------------------


class _EmulatedStream:
    """A CUDA stream stand-in: CPU work is already ordered, so every wait is satisfied."""

    cuda_stream = 0

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = _CPU
        self.priority = priority

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> Any:
        event = event if event is not None else _EmulatedEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class _EmulatedEvent:
    """A CUDA event stand-in; ``elapsed_time`` measures wall time between records (ms)."""

    def __init__(
        self,
        enable_timing: bool = False,
        blocking: bool = False,
        interprocess: bool = False,
        **kwargs: Any,
    ) -> None:
        self.enable_timing = enable_timing
        self._time: float | None = None

    def record(self, stream: Any = None) -> None:
        self._time = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end_event: _EmulatedEvent) -> float:
        if self._time is None or end_event._time is None:
            raise CudaEmulationError("Event.elapsed_time: both events must be recorded first")
        return (end_event._time - self._time) * 1000.0


_DEFAULT_STREAM = _EmulatedStream()


def _record_stream(original: Callable[..., Any]) -> Callable[..., Any]:
    # torch's argument parser rejects a non-CUDA stream before any TorchFunctionMode runs,
    # so the method itself is replaced for the scope.
    def record_stream(self: torch.Tensor, stream: Any) -> None:
        if isinstance(stream, _EmulatedStream):
            return None
        return original(self, stream)

    return record_stream


def _current_stream(device: Any = None) -> _EmulatedStream:
    return _DEFAULT_STREAM


@contextlib.contextmanager
def _stream_context(stream: Any = None) -> Iterator[Any]:
    yield stream


class _EmulatedGenerators:
    """``torch.cuda.default_generators``: every index is the CPU default generator."""

    def __getitem__(self, index: Any) -> torch.Generator:
        return torch.default_generator

    def __len__(self) -> int:
        return 1

    def __iter__(self) -> Iterator[torch.Generator]:
        return iter((torch.default_generator,))


def _get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.default_generator.get_state()


def _get_rng_state_all() -> list[torch.Tensor]:
    return [torch.default_generator.get_state()]


def _set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    torch.default_generator.set_state(new_state)


def _set_rng_state_all(new_states: Iterable[torch.Tensor]) -> None:
    for state in new_states:
        torch.default_generator.set_state(state)
        return


def _manual_seed(seed: int) -> None:
    # Not torch.manual_seed: it calls torch.cuda.manual_seed_all, i.e. this function.
    torch.default_generator.manual_seed(int(seed))


def _seed() -> None:
    torch.default_generator.seed()


def _initial_seed() -> int:
    return torch.default_generator.initial_seed()


def _call_now(callable: Callable[[], Any], **kwargs: Any) -> None:
    callable()


def _emulated_synchronize(device: Any = None) -> None:
    return None


def _emulated_current_device() -> torch.device:
    return _CPU


def _uncovered_lazy_init() -> None:
    frame = sys._getframe(1)
    module = frame.f_globals.get("__name__", "?")
    if module.startswith("torch.cuda"):
        caller = frame.f_back
        where = f"{caller.f_code.co_filename}:{caller.f_lineno}" if caller is not None else "?"
        what = f"{module}.{frame.f_code.co_qualname} (called from {where})"
    elif _device_rewriting_suspended():
        what = (
            f"a CUDA tensor created at {frame.f_code.co_filename}:{frame.f_lineno} "
            f"({frame.f_code.co_qualname}), inside core_utils.without_device_rewriting() "
            "(a block declared to ask for no CUDA device; move the request out of it),"
        )
    else:
        # torch's C++ side initialising CUDA for a tensor the device-rewriting mode did not
        # see (for example created in a thread that was running before the scope began).
        what = (
            f"a CUDA tensor created at {frame.f_code.co_filename}:{frame.f_lineno} "
            f"({frame.f_code.co_qualname}), outside the device-rewriting mode,"
        )
    raise CudaEmulationError(
        f"{what} needs a real CUDA device, and the CUDA emulation (core_utils.cuda_emulation) "
        "does not cover it; run this on a GPU or keep it out of the CPU path"
    )


# -- autocast -----------------------------------------------------------------------------

_OriginalAutocast = torch.amp.autocast_mode.autocast


def _refuse_cuda_autocast(what: str) -> CudaEmulationError:
    return CudaEmulationError(
        f"{what} is not emulated on CPU: torch would silently run without autocast. Use "
        "megatron's bf16/fp16 path (bf16=True: Float16Module and the mixed-precision "
        "optimizer) instead of enable_autocast, or train on a GPU"
    )


class _EmulatedAutocast(_OriginalAutocast):
    """``torch.autocast``: refuses an enabled CUDA autocast, passes other devices through."""

    def __init__(
        self,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
    ) -> None:
        if device_type == "cuda":
            if enabled:
                raise _refuse_cuda_autocast(f"torch.autocast('cuda', dtype={dtype})")
            device_type = "cpu"  # disabled: behaves the same, without torch's no-GPU warning
        super().__init__(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


def _cuda_amp_autocast(
    enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True
) -> Any:
    if enabled:
        raise _refuse_cuda_autocast("torch.cuda.amp.autocast")
    return _EmulatedAutocast("cuda", dtype=dtype, enabled=False, cache_enabled=cache_enabled)


# -- threads ------------------------------------------------------------------------------


def _covered_thread_start(original_start: Callable[..., Any]) -> Callable[..., Any]:
    def start(self: threading.Thread) -> Any:
        run = self.run

        def covered_run() -> None:
            with _thread_mode():
                run()

        self.run = covered_run  # type: ignore[method-assign]
        return original_start(self)

    start.__cuda_emulation_original__ = original_start  # type: ignore[attr-defined]
    return start


# -- install ------------------------------------------------------------------------------


class _DropSameGeneratorWarning(logging.Filter):
    """Drops megatron's 'CPU RNG state changed within GPU RNG context' (same generator here)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_RNG_LOGGER = "megatron.core.tensor_parallel.random"
_RNG_FILTER = _DropSameGeneratorWarning()


def _patches() -> list[tuple[Any, str, Any]]:
    cuda = torch.cuda
    c10d_a2a = torch.distributed.distributed_c10d.all_to_all_single
    patches: list[tuple[Any, str, Any]] = [
        (cuda, "Stream", _EmulatedStream),
        (cuda, "Event", _EmulatedEvent),
        (cuda, "current_stream", _current_stream),
        (cuda, "default_stream", _current_stream),
        (cuda, "stream", _stream_context),
        (cuda, "default_generators", _EmulatedGenerators()),
        (cuda, "get_rng_state", _get_rng_state),
        (cuda, "get_rng_state_all", _get_rng_state_all),
        (cuda, "set_rng_state", _set_rng_state),
        (cuda, "set_rng_state_all", _set_rng_state_all),
        (cuda, "manual_seed", _manual_seed),
        (cuda, "manual_seed_all", _manual_seed),
        (cuda, "seed", _seed),
        (cuda, "seed_all", _seed),
        (cuda, "initial_seed", _initial_seed),
        (cuda, "_lazy_call", _call_now),
        (cuda, "_lazy_init", _uncovered_lazy_init),
        (torch, "autocast", _EmulatedAutocast),
        (torch.amp, "autocast", _EmulatedAutocast),
        (cuda.amp, "autocast", _cuda_amp_autocast),
        (torch.Tensor, "record_stream", _record_stream(torch.Tensor.record_stream)),
        (torch.distributed, "all_to_all_single", a2a := _all_to_all_single(c10d_a2a)),
        (torch.distributed.distributed_c10d, "all_to_all_single", a2a),
        (threading.Thread, "start", _covered_thread_start(threading.Thread.start)),
    ]
    # cpu_cuda_compat owns torch.cuda.synchronize / current_device; other modules' own
    # bindings of them (torch.cuda.random's, megatron's) are this set's to rebind.
    for module in (cuda.random, cuda.memory):
        for name, replacement in (
            ("current_device", _emulated_current_device),
            ("synchronize", _emulated_synchronize),
        ):
            if hasattr(module, name):
                patches.append((module, name, replacement))
    return patches


def _on_install() -> None:
    logging.getLogger(_RNG_LOGGER).addFilter(_RNG_FILTER)


def _on_uninstall() -> None:
    logging.getLogger(_RNG_LOGGER).removeFilter(_RNG_FILTER)


_EMULATION = _ScopedPatchSet(
    _patches, requires=_COMPAT, on_install=_on_install, on_uninstall=_on_uninstall
)


def cuda_emulation_active() -> bool:
    """Return whether the CUDA emulation is installed (some scope is open, no CUDA)."""
    return _EMULATION.active


@contextlib.contextmanager
def cuda_emulation() -> Iterator[bool]:
    """Run the body with megatron-core's CUDA use redirected to the CPU when CUDA is absent.

    See the module docstring for what is covered, what fails loudly and what cannot be
    covered. Re-entrant (counted) and thread-aware; every patched attribute is restored when
    the outermost scope exits.

    Yields:
        ``True`` when the emulation is active, ``False`` when CUDA is available and the
        scope does nothing.

    Example:
        >>> with cuda_emulation():
        ...     torch.zeros(2, device="cuda").device.type
        'cpu'
    """
    with _EMULATION.scope() as active:
        if not active:
            yield False
            return
        with _thread_mode():
            yield True
