"""core_utils.cuda_emulation against megatron-core itself (one process, no process group).

Silent trap 1: megatron's ``tensor_parallel/random.py`` binds torch's ``_lazy_call`` at import;
without CUDA torch queues the callbacks forever, so ``CudaRNGStatesTracker.fork()`` would
neither switch to the tracked state nor restore the caller's. These tests pin the semantics
megatron relies on: inside ``fork()`` draws come from the tracked seed's stream, after it the
generator is exactly where it was, and successive forks continue the tracked stream.
"""

from __future__ import annotations

import pytest
import torch

from core_utils.cuda_emulation import CudaEmulationError, cuda_emulation

pytest.importorskip("megatron.core")

from megatron.core.tensor_parallel import random as megatron_random


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _stream(seed: int, n: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(n, generator=generator)


def test_rng_tracker_fork_switches_and_restores_the_cpu_generator(no_cuda: None) -> None:
    original_lazy_call = megatron_random._lazy_call
    with cuda_emulation():
        assert megatron_random._lazy_call is not original_lazy_call
        tracker = megatron_random.CudaRNGStatesTracker()
        torch.default_generator.manual_seed(1)
        tracker.add("model-parallel-rng", 77)
        # add() seeds, records and puts the caller's state back.
        assert torch.equal(torch.rand(4), _stream(1, 4))

        torch.default_generator.manual_seed(5)
        before = torch.get_rng_state()
        with tracker.fork("model-parallel-rng"):
            inside_first = torch.rand(3)
        assert torch.equal(torch.get_rng_state(), before), "fork() did not restore the state"
        assert torch.equal(inside_first, _stream(77, 3))
        outside = torch.rand(2)
        assert torch.equal(outside, _stream(5, 2))
        with tracker.fork("model-parallel-rng"):
            inside_second = torch.rand(3)
        # The tracked stream continues where the first fork left it.
        assert torch.equal(inside_second, _stream(77, 6)[3:])
    assert megatron_random._lazy_call is original_lazy_call


def test_megatron_set_cuda_rng_state_takes_effect_at_once(no_cuda: None) -> None:
    with cuda_emulation():
        state = megatron_random._get_cuda_rng_state()
        first = torch.rand(5)
        megatron_random._set_cuda_rng_state(state)
        assert torch.equal(torch.rand(5), first)


def test_megatron_cuda_autocast_is_refused(no_cuda: None) -> None:
    """schedules.py's ``torch.autocast("cuda")`` (config.enable_autocast) must not silently
    run without autocast."""
    from megatron.core.pipeline_parallel import schedules

    with cuda_emulation(), pytest.raises(CudaEmulationError, match="autocast"):
        schedules.torch.autocast("cuda", dtype=torch.bfloat16)
