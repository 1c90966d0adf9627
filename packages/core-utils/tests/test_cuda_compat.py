"""The CPU compatibility layer: what it patches, when, and that it undoes everything."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from core_utils import cpu_cuda_compat, cuda_compat_active
from core_utils.cuda_compat import gloo_backend_for
from core_utils.testing import run_distributed

c10d = dist.distributed_c10d


def _originals() -> dict[str, object]:
    return {
        "synchronize": torch.cuda.synchronize,
        "current_device": torch.cuda.current_device,
        "init_process_group": dist.init_process_group,
        "c10d.init_process_group": c10d.init_process_group,
        "new_group": dist.new_group,
        "c10d.new_group": c10d.new_group,
        "c10d._new_group_with_tag": c10d._new_group_with_tag,
    }


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the test independent of the machine: behave as on a CPU-only host."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_patches_apply_inside_and_are_undone_outside(no_cuda: None) -> None:
    before = _originals()
    assert not cuda_compat_active()
    with cpu_cuda_compat() as active:
        assert active and cuda_compat_active()
        inside = _originals()
        assert all(inside[name] is not before[name] for name in before)
        torch.cuda.synchronize()  # a no-op, not an error, without CUDA
        assert torch.cuda.current_device() == torch.device("cpu")
        assert torch.zeros(2, device=torch.cuda.current_device()).device.type == "cpu"
    assert not cuda_compat_active()
    assert _originals() == before


def test_nested_use_keeps_patches_until_the_outermost_exit(no_cuda: None) -> None:
    before = _originals()
    with cpu_cuda_compat():
        patched = _originals()
        with cpu_cuda_compat() as inner_active:
            assert inner_active
            assert _originals() == patched  # not patched twice
        assert cuda_compat_active()
        assert _originals() == patched
    assert _originals() == before


def test_an_exception_in_the_body_still_undoes_the_patches(no_cuda: None) -> None:
    before = _originals()
    with pytest.raises(KeyError), cpu_cuda_compat():
        raise KeyError("boom")
    assert _originals() == before and not cuda_compat_active()


def test_a_background_thread_keeps_the_patches_alive(no_cuda: None) -> None:
    entered, release, done = threading.Event(), threading.Event(), threading.Event()
    seen: list[object] = []

    def saver() -> None:
        with cpu_cuda_compat():
            entered.set()
            release.wait(30)
            seen.append(torch.cuda.current_device())
        done.set()

    before = _originals()
    thread = threading.Thread(target=saver)
    with cpu_cuda_compat():
        thread.start()
        assert entered.wait(30)
    # The starting thread has left; the saver thread is still inside.
    assert cuda_compat_active()
    release.set()
    thread.join(30)
    assert done.is_set() and seen == [torch.device("cpu")]
    assert _originals() == before and not cuda_compat_active()


def test_it_is_a_noop_when_cuda_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = _originals()
    with cpu_cuda_compat() as active:
        assert active is False and not cuda_compat_active()
        assert _originals() == before


def test_backend_translation() -> None:
    assert gloo_backend_for("nccl") == "gloo"
    assert gloo_backend_for("cuda:nccl") == "gloo"
    assert gloo_backend_for("cpu:gloo,cuda:nccl") == "gloo"
    assert gloo_backend_for(dist.Backend.NCCL) == "gloo"
    assert gloo_backend_for("gloo") == "gloo"
    assert gloo_backend_for("mpi") == "mpi"
    assert gloo_backend_for(None) is None


def _groups_on_ranks(rank: int, world_size: int, store_dir: str) -> dict[str, object]:
    out: dict[str, object] = {}
    real_cuda = torch.cuda.is_available()
    torch.cuda.is_available = lambda: False  # forked rank only
    with cpu_cuda_compat():
        group = dist.new_group(list(range(world_size)), backend="nccl", pg_options=object())
        assert isinstance(group, dist.ProcessGroup)  # every rank is a member
        out["new_group"] = dist.get_backend(group)
        tensor = torch.tensor([rank + 1.0])
        dist.all_reduce(tensor, group=group)
        out["sum"] = tensor.item()
        # torch's subgroup helper goes through the internal constructor, also patched.
        sub, _ = dist.new_subgroups_by_enumeration([[0], [1]], backend="cuda:nccl")
        assert isinstance(sub, dist.ProcessGroup)  # each rank's own subgroup
        out["subgroup"] = (dist.get_backend(sub), dist.get_world_size(sub))
        # Re-create the default group asking for nccl with a CUDA device id.
        dist.destroy_process_group()
        dist.init_process_group(
            "nccl",
            init_method=f"file://{store_dir}/store",
            rank=rank,
            world_size=world_size,
            device_id=torch.device("cuda", 0),
        )
        out["default"] = dist.get_backend()
        flag = torch.tensor([1], device=torch.cuda.current_device())
        dist.all_reduce(flag)
        out["flag"] = flag.item()
    out["restored"] = dist.new_group is c10d.new_group and not cuda_compat_active()
    if not real_cuda:  # outside the context nccl is nccl again, and fails without GPUs
        with pytest.raises((RuntimeError, ValueError), match=r"GPU|CUDA"):
            dist.new_group(list(range(world_size)), backend="nccl")
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_nccl_groups_become_gloo_on_two_ranks(tmp_path: Path) -> None:
    results = run_distributed(_groups_on_ranks, 2, str(tmp_path), timeout=100)
    for out in results:
        assert out["new_group"] == "gloo"
        assert out["sum"] == 3.0
        assert out["subgroup"] == ("gloo", 1)
        assert out["default"] == "gloo"
        assert out["flag"] == 2
        assert out["restored"] is True
