"""``without_device_rewriting``: the CUDA emulation's device rewriting suspended for a block.

Inside the block a CUDA device named by code fails loudly (it is not rewritten, and it does
not land anywhere silently); the emulation's process-wide patches still apply; the mode is
back after the block, whatever happened in it; a nested emulation scope gets it back.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from core_utils import without_device_rewriting
from core_utils.cuda_emulation import CudaEmulationError, cuda_emulation, cuda_emulation_active


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Behave as on a CPU-only host whatever the machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    yield
    assert not cuda_emulation_active(), "a test left the emulation active"


CUDA_REQUESTS = {
    "factory": lambda: torch.zeros(1, device="cuda"),
    "factory cuda:0": lambda: torch.empty(2, device="cuda:0"),
    "int index": lambda: torch.ones(1).to(0),
    "Tensor.cuda": lambda: torch.ones(1).cuda(),
    "Tensor.to": lambda: torch.ones(1).to("cuda", non_blocking=True),
    "torch.device": lambda: torch.tensor([1.0], device=torch.device("cuda", 0)),
}


@pytest.mark.parametrize("request_name", sorted(CUDA_REQUESTS))
def test_a_cuda_device_inside_fails_loudly_naming_the_block(
    no_cuda: None, request_name: str
) -> None:
    with cuda_emulation():
        assert CUDA_REQUESTS[request_name]().device.type == "cpu"  # rewritten outside
        with without_device_rewriting() as suspended:
            assert suspended
            with pytest.raises(CudaEmulationError, match=r"without_device_rewriting\(\)"):
                CUDA_REQUESTS[request_name]()
        assert CUDA_REQUESTS[request_name]().device.type == "cpu"  # and again after


def test_pin_memory_inside_fails_loudly(no_cuda: None) -> None:
    with cuda_emulation(), without_device_rewriting(), pytest.raises(RuntimeError):
        torch.ones(1).pin_memory()


def test_process_wide_patches_still_apply_and_type_names_are_the_real_ones(
    no_cuda: None,
) -> None:
    with cuda_emulation():
        assert torch.ones(1).type() == "torch.cuda.FloatTensor"
        with without_device_rewriting():
            assert torch.cuda.current_device() == torch.device("cpu")
            torch.cuda.synchronize()
            torch.cuda.current_stream().synchronize()
            assert torch.zeros(2, device=torch.cuda.current_device()).device.type == "cpu"
            # No mode: a CPU tensor says what it is (megatron's optimizers check CUDA type
            # names, so they must not run inside such a block).
            assert torch.ones(1).type() == "torch.FloatTensor"
            assert (torch.ones(3) * 2).sum().item() == 6.0


def test_the_mode_comes_back_after_an_exception(no_cuda: None) -> None:
    with cuda_emulation():
        with pytest.raises(ValueError), without_device_rewriting():
            raise ValueError("inside")
        assert torch.zeros(1, device="cuda").device.type == "cpu"


def test_a_nested_emulation_scope_gets_the_rewriting_back(no_cuda: None) -> None:
    with cuda_emulation(), without_device_rewriting():
        with cuda_emulation():
            assert torch.zeros(1, device="cuda").device.type == "cpu"
            with without_device_rewriting() as again:
                assert again
                with pytest.raises(CudaEmulationError):
                    torch.zeros(1, device="cuda")
            assert torch.zeros(1, device="cuda").device.type == "cpu"
        with pytest.raises(CudaEmulationError):
            torch.zeros(1, device="cuda")


class _Counting(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_a_no_op_where_it_cannot_suspend(no_cuda: None) -> None:
    """Outside the emulation, inside another suspension, and under a mode pushed above the
    emulation's (popping from under it would reorder the stack): the body runs as it is."""
    with without_device_rewriting() as suspended:
        assert not suspended
    with cuda_emulation():
        with without_device_rewriting(), without_device_rewriting() as inner:
            assert not inner
        counting = _Counting()
        with counting, without_device_rewriting() as suspended:
            assert not suspended
            assert torch.zeros(1, device="cuda").device.type == "cpu"
        assert counting.calls > 0


def test_a_no_op_when_cuda_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with cuda_emulation() as active, without_device_rewriting() as suspended:
        assert not active and not suspended


def test_threads_started_inside_are_still_covered(no_cuda: None) -> None:
    results: list[str] = []
    with cuda_emulation(), without_device_rewriting():
        thread = threading.Thread(
            target=lambda: results.append(torch.zeros(1, device="cuda").device.type)
        )
        thread.start()
        thread.join(timeout=60)
    assert results == ["cpu"]
