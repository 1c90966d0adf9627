"""The CUDA emulation layer: every covered entry point, loud failures, scope, threads."""

from __future__ import annotations

import logging
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from core_utils import cuda_compat_active
from core_utils.cuda_emulation import CudaEmulationError, cuda_emulation, cuda_emulation_active

CUDA_ATTRIBUTES = (
    "synchronize",
    "current_device",
    "Stream",
    "Event",
    "current_stream",
    "default_stream",
    "stream",
    "default_generators",
    "get_rng_state",
    "get_rng_state_all",
    "set_rng_state",
    "set_rng_state_all",
    "manual_seed",
    "manual_seed_all",
    "seed",
    "seed_all",
    "initial_seed",
    "_lazy_call",
    "_lazy_init",
)


def _originals() -> dict[str, object]:
    out: dict[str, object] = {f"torch.cuda.{n}": getattr(torch.cuda, n) for n in CUDA_ATTRIBUTES}
    for module in (torch.cuda.random, torch.cuda.memory):
        for name in ("current_device", "synchronize", "_lazy_call", "_lazy_init"):
            if hasattr(module, name):
                out[f"{module.__name__}.{name}"] = getattr(module, name)
    out.update(
        {
            "torch.autocast": torch.autocast,
            "torch.amp.autocast": torch.amp.autocast,
            "torch.cuda.amp.autocast": torch.cuda.amp.autocast,
            "Thread.start": threading.Thread.start,
            "dist.all_to_all_single": dist.all_to_all_single,
            "c10d.all_to_all_single": dist.distributed_c10d.all_to_all_single,
            "Tensor.record_stream": torch.Tensor.record_stream,
            "dist.new_group": dist.new_group,
            "dist.init_process_group": dist.init_process_group,
            "c10d._new_group_with_tag": dist.distributed_c10d._new_group_with_tag,
            "rng log filters": list(
                logging.getLogger("megatron.core.tensor_parallel.random").filters
            ),
        }
    )
    return out


def _assert_all_original(before: dict[str, object]) -> None:
    after = _originals()
    changed = [name for name in before if after[name] is not before[name]]
    changed = [n for n in changed if not (n == "rng log filters" and after[n] == before[n])]
    assert not changed, f"not restored: {changed}"


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Behave as on a CPU-only host whatever the machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    yield
    assert not cuda_emulation_active(), "a test left the emulation active"


# -- scope ------------------------------------------------------------------------------


def test_every_patched_attribute_is_the_original_after_exit(no_cuda: None) -> None:
    before = _originals()
    with cuda_emulation() as active:
        assert active and cuda_emulation_active() and cuda_compat_active()
        during = _originals()
        assert all(during[n] is not before[n] for n in before if n != "rng log filters")
    _assert_all_original(before)
    assert not cuda_emulation_active() and not cuda_compat_active()


def test_nested_scopes_are_counted_and_an_exception_still_restores(no_cuda: None) -> None:
    before = _originals()
    with cuda_emulation():
        inner_patch = torch.cuda.get_rng_state
        with cuda_emulation() as inner:
            assert inner and torch.cuda.get_rng_state is inner_patch
        assert cuda_emulation_active() and torch.cuda.get_rng_state is inner_patch
        assert torch.zeros(1, device="cuda").device.type == "cpu"  # mode still pushed
    _assert_all_original(before)
    with pytest.raises(KeyError), cuda_emulation():
        raise KeyError("boom")
    _assert_all_original(before)


def test_compat_scope_inside_and_around_emulation(no_cuda: None) -> None:
    """cpu_cuda_compat (a subset) nests either way without undoing the other's patches."""
    from core_utils import cpu_cuda_compat

    before = _originals()
    with cpu_cuda_compat():
        with cuda_emulation():
            assert torch.cuda.current_stream() is not None
        assert cuda_compat_active() and not cuda_emulation_active()
        assert torch.cuda.current_device() == torch.device("cpu")
    _assert_all_original(before)


def test_a_no_op_when_cuda_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = _originals()
    with cuda_emulation() as active:
        assert active is False and not cuda_emulation_active()
        assert _originals() == before
        assert torch.Tensor.type(torch.ones(1)) == "torch.FloatTensor"  # no mode either


def test_module_bindings_are_rebound_and_restored(no_cuda: None) -> None:
    """A module that did ``from torch.cuda import _lazy_call`` (as megatron's random.py does)
    gets the run-at-once version inside, its original after; one imported inside the scope
    is given the original back on exit."""
    early: Any = types.ModuleType("fake_early_binder")
    early._lazy_call = torch.cuda._lazy_call
    early.get_rng_state = torch.cuda.get_rng_state
    original_lazy_call = torch.cuda._lazy_call
    sys.modules["fake_early_binder"] = early
    try:
        with cuda_emulation():
            assert early._lazy_call is not original_lazy_call
            ran: list[int] = []
            early._lazy_call(lambda: ran.append(1))
            assert ran == [1]
            late: Any = types.ModuleType("fake_late_binder")
            late._lazy_call = torch.cuda._lazy_call
            sys.modules["fake_late_binder"] = late
        assert early._lazy_call is original_lazy_call
        assert late._lazy_call is original_lazy_call
        assert early.get_rng_state is torch.cuda.get_rng_state
    finally:
        sys.modules.pop("fake_early_binder", None)
        sys.modules.pop("fake_late_binder", None)


# -- devices ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "device", ["cuda", "cuda:0", "cuda:1", torch.device("cuda"), torch.device("cuda", 1), 0, 3]
)
def test_cuda_devices_in_factories_and_to_become_cpu(
    no_cuda: None, device: str | torch.device | int
) -> None:
    base = torch.arange(4.0)
    with cuda_emulation():
        made = [
            torch.zeros(2, device=device),
            torch.empty(2, 3, device=device, dtype=torch.bfloat16),
            torch.tensor([1.0], device=device),
            torch.full((2,), 7.0, device=device),
            torch.empty_like(base, device=device),
            base.new_zeros(3, device=device),
            base.to(device),
            base.to(device, torch.float64),
            base.to(device=device, non_blocking=True),
        ]
    assert all(t.device.type == "cpu" for t in made)
    assert made[1].dtype == torch.bfloat16 and made[7].dtype == torch.float64


def test_calls_without_keywords_take_the_fast_path_with_the_same_semantics(
    no_cuda: None,
) -> None:
    """Most torch calls carry no keyword arguments and run straight through the mode; the
    methods whose device may be positional (``to``, ``cuda``, ``type``, ``pin_memory``)
    are still handled, and keyword arguments other than ``device`` are passed on."""
    base = torch.arange(6.0).reshape(2, 3)

    def plain() -> list[torch.Tensor]:
        return [
            torch.add(base, base),
            base.mul(2),
            base.sum(0),
            torch.cat([base, base]),
            base.t().contiguous(),
            torch.zeros(2, 3),
            base.sum(dim=1),
            torch.ones(2, dtype=torch.float64),
        ]

    outside = plain()
    with cuda_emulation():
        inside = plain()
        assert base.shape == (2, 3) and base.grad is None and base.dtype == torch.float32
        moved = [base.to("cuda"), base.to(torch.device("cuda", 0), torch.float64), base.to(1)]
        same = [base.cuda(), base.cuda(1), base.pin_memory()]
        name = base.type()
    for want, got in zip(outside, inside, strict=True):
        assert torch.equal(want, got) and want.dtype == got.dtype and got.device.type == "cpu"
    assert all(t.device.type == "cpu" for t in moved) and moved[1].dtype == torch.float64
    assert all(t is base for t in same)
    assert name == "torch.cuda.FloatTensor"


def test_cuda_and_pin_memory_return_the_tensor(no_cuda: None) -> None:
    module = torch.nn.Linear(3, 2)
    weight = module.weight
    with cuda_emulation():
        tensor = torch.ones(3)
        assert tensor.cuda() is tensor and tensor.cuda(0) is tensor
        assert tensor.cuda(non_blocking=True) is tensor
        assert tensor.pin_memory() is tensor
        assert module.cuda() is module and module.weight is weight
        data = module.weight.data.cuda()
        assert data.data_ptr() == weight.data_ptr()
        tensor.record_stream(torch.cuda.current_stream())


def test_tensor_type_reports_cuda_names_and_converts_cuda_types(no_cuda: None) -> None:
    with cuda_emulation():
        assert torch.ones(1).type() == "torch.cuda.FloatTensor"
        assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert torch.ones(1, dtype=torch.float16).type() == "torch.cuda.HalfTensor"
        assert torch.ones(1).type("torch.cuda.HalfTensor").dtype == torch.float16
        assert torch.ones(1).type(torch.cuda.DoubleTensor).dtype == torch.float64  # type: ignore[attr-defined]
        assert torch.ones(1).type(dtype=torch.float64).dtype == torch.float64
    assert torch.ones(1).type() == "torch.FloatTensor"


def test_streams_events_and_stream_context(no_cuda: None) -> None:
    with cuda_emulation():
        current = torch.cuda.current_stream()
        assert current is torch.cuda.default_stream()
        side = torch.cuda.Stream(device=0, priority=-1)
        side.wait_stream(current)
        with torch.cuda.stream(side) as entered:
            assert entered is side
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        end.record(side)
        end.wait(current)
        current.wait_event(end)
        assert end.query() and side.query()
        assert start.elapsed_time(end) >= 0.0
        assert isinstance(side.record_event(), torch.cuda.Event)
        with pytest.raises(CudaEmulationError, match="recorded"):
            torch.cuda.Event().elapsed_time(end)


# -- RNG ----------------------------------------------------------------------------------


def test_cuda_rng_is_the_cpu_generator(no_cuda: None) -> None:
    with cuda_emulation():
        torch.cuda.manual_seed(11)
        first = torch.rand(3)
        torch.default_generator.manual_seed(11)
        assert torch.equal(torch.rand(3), first)

        state = torch.cuda.get_rng_state()
        assert torch.equal(state, torch.get_rng_state())
        drawn = torch.rand(4)
        torch.cuda.set_rng_state(state)
        assert torch.equal(torch.rand(4), drawn)
        torch.cuda.set_rng_state_all(torch.cuda.get_rng_state_all())

        torch.cuda.manual_seed_all(5)
        assert torch.cuda.initial_seed() == 5
        torch.manual_seed(6)  # goes through torch.cuda.manual_seed_all: must not recurse
        assert torch.initial_seed() == 6
        assert torch.cuda.default_generators[0] is torch.default_generator
        cpu_index: Any = torch.device("cpu")
        assert torch.cuda.default_generators[cpu_index] is torch.default_generator
        assert len(torch.cuda.default_generators) == 1


def test_lazy_calls_run_at_once(no_cuda: None) -> None:
    """Silent trap 1: torch queues _lazy_call callbacks until CUDA initialises (never here)."""
    ran: list[str] = []
    with cuda_emulation():
        torch.cuda._lazy_call(lambda: ran.append("now"))
        assert ran == ["now"]


def test_same_generator_warning_of_megatron_is_dropped_only_inside(no_cuda: None) -> None:
    logger = logging.getLogger("megatron.core.tensor_parallel.random")
    record = logger.makeRecord(
        logger.name,
        logging.WARNING,
        __file__,
        0,
        "CPU RNG state changed within GPU RNG context",
        (),
        None,
    )
    with cuda_emulation():
        assert not logger.filter(record)
    assert logger.filter(record)


# -- loud failures ------------------------------------------------------------------------


def test_uncovered_cuda_calls_fail_loudly_naming_the_call(no_cuda: None) -> None:
    with cuda_emulation():
        with pytest.raises(CudaEmulationError, match=r"get_device_properties.*test_cuda_emu"):
            torch.cuda.get_device_properties(0)
        with pytest.raises(CudaEmulationError, match=r"torch.autocast\('cuda'"):
            torch.autocast("cuda", dtype=torch.bfloat16)
        with pytest.raises(CudaEmulationError, match=r"torch.cuda.amp.autocast"):
            torch.cuda.amp.autocast()
        with torch.autocast("cuda", enabled=False):
            assert not torch.is_autocast_enabled("cpu")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.is_autocast_enabled("cpu")
        assert isinstance(torch.autocast("cpu", enabled=False), torch.amp.autocast_mode.autocast)


class _CudaInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        torch.zeros(1, device="cuda")
        return grad * 2


def test_a_cuda_device_in_backward_fails_loudly(no_cuda: None) -> None:
    """Documented limit: autograd does not carry the TorchFunctionMode into backward."""
    with cuda_emulation():
        x = torch.ones(2, requires_grad=True)
        with pytest.raises(CudaEmulationError, match=r"outside the device-rewriting mode"):
            _CudaInBackward.apply(x).sum().backward()


# -- threads (silent trap 2) ---------------------------------------------------------------


def _device_in_thread(results: list[object]) -> None:
    try:
        results.append(torch.zeros(1, device="cuda").device.type)
    except Exception as exc:  # recorded and asserted by the test
        results.append(exc)


def test_threads_started_inside_are_covered(no_cuda: None) -> None:
    results: list[object] = []
    with cuda_emulation():
        thread = threading.Thread(target=_device_in_thread, args=(results,))
        thread.start()
        thread.join(timeout=60)
    assert results == ["cpu"]


def test_a_covered_thread_outliving_the_scope_fails_loudly(no_cuda: None) -> None:
    release = threading.Event()
    results: list[object] = []

    def later() -> None:
        release.wait(timeout=60)
        _device_in_thread(results)

    with cuda_emulation():
        thread = threading.Thread(target=later)
        thread.start()
    release.set()
    thread.join(timeout=60)
    assert len(results) == 1 and isinstance(results[0], CudaEmulationError)
    assert "outlived" in str(results[0])


def test_threads_started_before_the_scope_are_not_covered(no_cuda: None) -> None:
    """Documented limit: a thread already running is not covered; its CUDA tensor fails
    loudly, naming where it was created."""
    go, done = threading.Event(), threading.Event()
    results: list[object] = []

    def waiting() -> None:
        go.wait(timeout=60)
        _device_in_thread(results)
        done.set()

    thread = threading.Thread(target=waiting)
    thread.start()
    with cuda_emulation():
        go.set()
        done.wait(timeout=60)
    thread.join(timeout=60)
    assert len(results) == 1 and isinstance(results[0], CudaEmulationError)
    assert "a CUDA tensor created at" in str(results[0]) and "_device_in_thread" in str(results[0])


def _all_to_all_with_tensor_splits(rank: int, world_size: int) -> list[float]:
    with cuda_emulation():
        # Rank 0 sends [0] to itself and [1, 2] to rank 1; rank 1 sends [10, 11] to rank 0
        # and [12] to itself. Split sizes as tensors, as megatron's dispatcher has them.
        data = torch.arange(3.0) + 10 * rank
        splits = torch.tensor([1, 2]) if rank == 0 else torch.tensor([2, 1])
        received = torch.tensor([1, 2]) if rank == 0 else torch.tensor([2, 1])
        out = torch.empty(int(received.sum()))
        dist.all_to_all_single(
            out,
            data,
            output_split_sizes=received,  # type: ignore[arg-type]
            input_split_sizes=splits,  # type: ignore[arg-type]
        )
    return out.tolist()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_all_to_all_single_accepts_tensor_split_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    from core_utils.testing import run_distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    results = run_distributed(_all_to_all_with_tensor_splits, 2, timeout=100)
    assert results == [[0.0, 10.0, 11.0], [1.0, 2.0, 12.0]]
