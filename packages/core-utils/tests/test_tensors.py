"""Viewless tensors, WrappedTensor, maybe_cat, memory buffers and init methods."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import pytest
import torch

import core_utils
from core_utils.viewless import _kernel_make_viewless_tensor


def test_make_viewless_tensor_without_graph() -> None:
    base = torch.zeros(3, 4)
    view = base[1]
    assert view._base is base
    plain = torch.ones(3)
    assert core_utils.make_viewless_tensor(plain, requires_grad=False, keep_graph=False) is plain
    viewless = core_utils.make_viewless_tensor(view, requires_grad=False, keep_graph=False)
    assert viewless._base is None
    assert torch.equal(viewless, view)
    assert viewless.data_ptr() == view.data_ptr()  # shares the data
    assert core_utils.assert_viewless_tensor(viewless) is viewless
    assert _kernel_make_viewless_tensor(view, True).requires_grad


def test_make_viewless_tensor_keeps_the_graph() -> None:
    leaf = torch.arange(6.0, requires_grad=True)
    view = (leaf * 2).view(2, 3)
    assert view._base is not None
    viewless = core_utils.make_viewless_tensor(view, requires_grad=True, keep_graph=True)
    assert viewless._base is None and viewless.grad_fn is not None
    (viewless * torch.arange(6.0).view(2, 3)).sum().backward()
    assert leaf.grad is not None
    assert torch.equal(leaf.grad, 2 * torch.arange(6.0))
    assert isinstance(core_utils.MakeViewlessTensor.apply(view, True), torch.Tensor)


def test_assert_viewless_tensor_on_views_lists_and_non_tensors() -> None:
    base = torch.zeros(4, 4)
    with pytest.raises(ValueError, match=r"got a view of shape \(4,\) of a base .*\(4, 4\).*extra"):
        core_utils.assert_viewless_tensor(base[0], extra_msg="extra")
    with pytest.raises(ValueError, match="viewless"):
        core_utils.assert_viewless_tensor([torch.zeros(1), base[:, 1]])
    items = [torch.zeros(1), "text", None]
    assert core_utils.assert_viewless_tensor(items) is items
    assert core_utils.assert_viewless_tensor(3) == 3


def test_safely_set_viewless_tensor_data() -> None:
    tensor = torch.zeros(2)
    core_utils.safely_set_viewless_tensor_data(tensor, torch.ones(5))
    assert torch.equal(tensor, torch.ones(5))
    view = torch.zeros(3, 3)[0]
    with pytest.raises(ValueError, match=r"view of shape \(3,\).*new_data_tensor has shape \(7,\)"):
        core_utils.safely_set_viewless_tensor_data(view, torch.ones(7))
    assert torch.equal(view, torch.zeros(3))  # untouched


def test_wrapped_tensor_unwraps_once() -> None:
    tensor = torch.ones(2)
    wrapped = core_utils.WrappedTensor(tensor)
    del tensor
    first = wrapped.unwrap()
    assert torch.equal(first, torch.ones(2))
    with pytest.raises(
        RuntimeError, match="already been unwrapped; unwrap\\(\\) may be called only once"
    ):
        wrapped.unwrap()


def test_maybe_cat() -> None:
    a, b = torch.ones(2, 3), torch.zeros(1, 3)
    assert torch.equal(core_utils.maybe_cat(a, b), torch.cat([a, b]))  # type: ignore[arg-type]
    assert torch.equal(core_utils.maybe_cat(a, b, dim=0), torch.cat([a, b]))  # type: ignore[arg-type]
    assert core_utils.maybe_cat(torch.ones(2, 1), torch.ones(2, 2), dim=1).shape == (2, 3)  # type: ignore[union-attr]
    assert core_utils.maybe_cat(a, None) is a
    assert core_utils.maybe_cat(None, b) is b
    assert core_utils.maybe_cat(None, None) is None
    with pytest.raises(ValueError, match="both a and b are None"):
        core_utils.maybe_cat(None, None, required=True)


def test_global_memory_buffer_reuses_and_grows() -> None:
    buffers = core_utils.GlobalMemoryBuffer()
    first = buffers.get_tensor((2, 3), torch.float32, "act")
    assert first.shape == (2, 3) and first.device.type == (
        "cuda" if torch.cuda.is_available() else "cpu"
    )
    storage = buffers.buffer[("act", torch.float32)]
    smaller = buffers.get_tensor((4,), torch.float32, "act")
    assert smaller.data_ptr() == first.data_ptr()  # reused
    assert buffers.buffer[("act", torch.float32)] is storage
    other_dtype = buffers.get_tensor((4,), torch.float16, "act")
    assert other_dtype.dtype == torch.float16 and other_dtype.data_ptr() != first.data_ptr()
    other_name = buffers.get_tensor((4,), torch.float32, "grad")
    assert other_name.data_ptr() != first.data_ptr()
    bigger = buffers.get_tensor((10, 10), torch.float32, "act")
    assert buffers.buffer[("act", torch.float32)].numel() == 100 and bigger.shape == (10, 10)
    entered: list[bool] = []

    @contextlib.contextmanager
    def pool() -> Iterator[None]:
        entered.append(True)
        yield

    buffers.get_tensor((3,), torch.float32, "act", mem_alloc_context=pool)  # fits: no alloc
    assert not entered
    buffers.get_tensor((200,), torch.float32, "act", mem_alloc_context=pool)
    assert entered == [True]
    cpu = buffers.get_tensor((2,), torch.float32, "act", device="cpu")
    assert cpu.device.type == "cpu"
    with pytest.raises(ValueError, match="negative sizes"):
        buffers.get_tensor((-1, 2), torch.float32, "act")


def test_global_memory_buffer_scalar_shape() -> None:
    buffers = core_utils.GlobalMemoryBuffer()
    vector = buffers.get_tensor((3,), torch.float32, "loss", device="cpu")
    vector.copy_(torch.tensor([7.0, 8.0, 9.0]))
    scalar = buffers.get_tensor((), torch.float32, "loss", device="cpu")
    # A 0-d view of the first element of the same storage.
    assert scalar.shape == () and scalar.dim() == 0
    assert scalar.data_ptr() == vector.data_ptr() and scalar.item() == 7.0
    fresh = buffers.get_tensor([], torch.int64, "count", device="cpu")
    assert fresh.shape == () and buffers.buffer[("count", torch.int64)].numel() == 1


def test_global_symmetric_memory_buffer_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("this checks the CPU fallback")
    buffer = core_utils.GlobalSymmetricMemoryBuffer(size_in_mb=1, process_group=None)
    assert buffer.symm_buffer is None and buffer.symm_mem_hdl is None
    assert buffer.unavailable_reason is not None and "CUDA" in buffer.unavailable_reason
    assert buffer.maybe_get_tensor((4, 4), torch.float32) is None
    assert buffer._can_allocate(16, torch.float32) is False
    with pytest.raises(RuntimeError, match="unavailable"):
        buffer._allocate(16, torch.float32)
    with pytest.raises(ValueError, match="size_in_mb must be > 0"):
        core_utils.GlobalSymmetricMemoryBuffer(size_in_mb=0, process_group=None)


def test_global_symmetric_memory_buffer_without_a_process_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """process_group=None without a default group: unavailable, not an exception.

    CUDA is reported as available so that construction gets past the CUDA check, as it
    would on a GPU machine where torch.distributed was not initialised.
    """
    assert not torch.distributed.is_initialized()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    buffer = core_utils.GlobalSymmetricMemoryBuffer(size_in_mb=1, process_group=None)
    assert buffer.symm_buffer is None and buffer.symm_mem_hdl is None
    assert buffer.unavailable_reason is not None
    assert "torch.distributed is not initialised" in buffer.unavailable_reason
    assert buffer.maybe_get_tensor((4, 4), torch.float32) is None


def test_symmetric_buffer_views_when_memory_exists() -> None:
    """The sub-tensor arithmetic, on a buffer as rendezvous would have produced it."""
    buffer = core_utils.GlobalSymmetricMemoryBuffer.__new__(core_utils.GlobalSymmetricMemoryBuffer)
    buffer.symm_buffer = torch.zeros(64, dtype=torch.uint8)
    buffer.symm_mem_hdl = object()
    buffer.unavailable_reason = None
    view = buffer.maybe_get_tensor((2, 4), torch.float32)
    assert view is not None and view.shape == (2, 4) and view.dtype == torch.float32
    assert view.data_ptr() == buffer.symm_buffer.data_ptr()
    assert buffer.maybe_get_tensor((17,), torch.float32) is None  # 68 bytes do not fit
    assert buffer.maybe_get_tensor((32,), torch.bfloat16) is not None
    scalar = buffer.maybe_get_tensor((), torch.float32)
    assert scalar is not None and scalar.shape == () and scalar.data_ptr() == view.data_ptr()


def test_init_methods() -> None:
    torch.manual_seed(0)
    weight = torch.empty(400, 400)
    core_utils.init_method_normal(0.02)(weight)
    assert abs(weight.std().item() - 0.02) < 0.002 and abs(weight.mean().item()) < 0.002
    core_utils.scaled_init_method_normal(0.02, num_layers=8)(weight)
    assert abs(weight.std().item() - 0.02 / math.sqrt(16)) < 0.0005
    core_utils.scaled_init_method_normal(0.02, num_layers=8, multiplier=1.0)(weight)
    assert abs(weight.std().item() - 0.02 / math.sqrt(8)) < 0.0008
    with pytest.raises(ValueError, match="num_layers must be > 0, got 0"):
        core_utils.scaled_init_method_normal(0.02, num_layers=0)
    with pytest.raises(ValueError, match="sigma must be >= 0"):
        core_utils.init_method_normal(-1.0)
