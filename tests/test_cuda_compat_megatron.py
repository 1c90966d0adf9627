"""core_utils.cpu_cuda_compat lets megatron-core's CUDA-assuming code run on CPU (gloo).

dist_checkpointing save, megatron's own Timers and HyperCommGrid groups requested with
nccl all call CUDA-only functions; inside the compatibility layer they work on 2 gloo ranks,
and outside it the patches are gone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from core_utils import cpu_cuda_compat, cuda_compat_active
from core_utils.testing import run_distributed

pytest.importorskip("megatron.core")  # the integration venv always has it

# Imported before the ranks fork, so each rank does not pay megatron's import time again.
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies.filesystem_async import (
    get_write_results_queue,
)
from megatron.core.hyper_comm_grid import HyperCommGrid
from megatron.core.timers import Timers as MegatronTimers

ROWS, COLS = 6, 4


def _fork_context_results_queue() -> None:
    """Create dist_checkpointing's write-results queue with a fork-context Manager.

    By default save creates it on first use from a *spawn* context: a fresh interpreter that
    re-imports the main module, torch and megatron-core (about a minute per rank on a loaded
    2-core machine, for a save that takes milliseconds). A per-rank fork of the already
    loaded rank costs nothing. Called on each rank: ranks must not share one queue.
    """
    get_write_results_queue(mp_mode="fork")


def _sharded_state(rank: int, world_size: int, fill: bool) -> dict[str, ShardedTensor]:
    rows = ROWS // world_size
    full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    local = full[rank * rows : (rank + 1) * rows].clone() if fill else torch.zeros(rows, COLS)
    bias = torch.full((3,), 7.0) if fill else torch.zeros(3)
    return {
        # Split along dim 0 across ranks, like a tensor-parallel weight.
        "layer.weight": ShardedTensor.from_rank_offsets(
            "layer.weight", local, (0, rank, world_size)
        ),
        # Replicated: rank 0 holds the main replica.
        "layer.bias": ShardedTensor.from_rank_offsets("layer.bias", bias, replica_id=rank),
    }


def _save_load_on_ranks(rank: int, world_size: int, ckpt_dir: str) -> dict[str, object]:
    _fork_context_results_queue()
    out: dict[str, object] = {}
    original_sync = torch.cuda.synchronize
    with cpu_cuda_compat() as active:
        out["active"] = active
        # Groups megatron asks for with nccl come out as gloo.
        grid = HyperCommGrid([world_size, 1], ["tp", "dp"], backend="nccl")
        tp_group = grid.create_pg(["tp"])
        out["grid_backend"] = dist.get_backend(tp_group)
        out["grid_size"] = dist.get_world_size(tp_group)
        # megatron's Timers calls torch.cuda.synchronize and gathers on current_device().
        timers = MegatronTimers(log_level=2, log_option="minmax")
        timers("save").start()
        dist_checkpointing.save(_sharded_state(rank, world_size, fill=True), ckpt_dir)
        timers("save").stop()
        out["timer_string"] = timers.get_all_timers_string(["save"])
    out["restored"] = torch.cuda.synchronize is original_sync and not cuda_compat_active()
    # Load outside the layer: it needs no patches.
    loaded = dist_checkpointing.load(_sharded_state(rank, world_size, fill=False), ckpt_dir)
    out["weight"] = loaded["layer.weight"].tolist()
    out["bias"] = loaded["layer.bias"].tolist()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_dist_checkpointing_save_and_load_on_two_gloo_ranks(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("the compatibility layer is a no-op with CUDA; this checks the CPU path")
    ckpt_dir = tmp_path / "ckpt"
    ckpt_dir.mkdir()
    results = run_distributed(_save_load_on_ranks, 2, str(ckpt_dir), timeout=160)
    full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    for rank, out in enumerate(results):
        assert out["active"] is True
        assert out["grid_backend"] == "gloo" and out["grid_size"] == 2
        assert "(min, max) time across ranks (ms)" in str(out["timer_string"])
        assert out["restored"] is True
        assert out["weight"] == full[rank * 3 : (rank + 1) * 3].tolist()
        assert out["bias"] == [7.0, 7.0, 7.0]
    assert (ckpt_dir / "metadata.json").exists()


def test_megatron_timers_need_the_layer_on_cpu() -> None:
    """The reason the layer exists: megatron's CUDA calls fail on CPU without it."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU machine megatron's timers work without the layer")
    timers = MegatronTimers(log_level=2, log_option="max")
    with pytest.raises((RuntimeError, AssertionError), match=r"CUDA|NVIDIA|driver"):
        timers("outside").start()
    with cpu_cuda_compat():
        timers("inside").start()
        timers("inside").stop()
        assert timers("inside").elapsed() >= 0.0
    assert not cuda_compat_active()
