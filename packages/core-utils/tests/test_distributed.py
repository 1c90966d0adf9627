"""Multi-rank behaviour over gloo, checked in one 2-rank launch to keep CI time low."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch._dynamo  # DTensor dispatch imports it: load it once, before the ranks fork
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import core_utils
from core_utils.testing import run_distributed


class _Config:
    sequence_parallel = True
    gradient_accumulation_fusion = True


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _group(ranks: list[int]) -> dist.ProcessGroup | None:
    """``dist.new_group`` (every rank must call it); None on ranks outside ``ranks``."""
    group = dist.new_group(ranks)
    return group if isinstance(group, dist.ProcessGroup) else None


def _process_groups(rank: int, out: dict[str, Any]) -> None:
    world = _group([0, 1])
    # Every rank takes part in creating every group, member or not.
    singles = [_group([0]), _group([1])]
    out["pg"] = (
        core_utils.get_pg_size(world),
        core_utils.get_pg_rank(world),
        core_utils.get_pg_src_rank(world),
        core_utils.get_pg_size(None),
        core_utils.get_pg_rank(None),
    )
    # Each rank's own one-member group: its source is that rank's global rank (1 on rank 1).
    mine = singles[rank]
    out["solo"] = (
        core_utils.get_pg_size(mine),
        core_utils.get_pg_rank(mine),
        core_utils.get_pg_src_rank(mine),
    )


def _param_hashes(rank: int, out: dict[str, Any]) -> None:
    torch.manual_seed(0)
    first, last = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    model = torch.nn.Sequential(first, last)
    expert = torch.nn.Linear(2, 2)
    expert.weight.allreduce = False  # type: ignore[attr-defined]
    out["same"] = core_utils.check_param_hashes_across_dp_replicas([model, expert])
    out["same_cross"] = core_utils.check_param_hashes_across_dp_replicas(
        [model, expert], cross_check=True
    )
    if rank == 1:  # a replica drifts
        with torch.no_grad():
            last.bias[0] += 1e-3
    out["diverged"] = core_utils.check_param_hashes_across_dp_replicas([model])
    out["diverged_cross"] = core_utils.check_param_hashes_across_dp_replicas(
        [model], cross_check=True, dp_group=_group([0, 1])
    )


def _dtensors(rank: int, out: dict[str, Any]) -> None:
    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(8.0).reshape(4, 2)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    out["local"] = core_utils.to_local_if_dtensor(sharded).tolist()
    out["if_necessary"] = core_utils.get_full_tensor_if_necessary(sharded).tolist()
    # One row over two ranks: one rank's shard would be empty, so the full tensor comes back.
    tiny = distribute_tensor(torch.tensor([[5.0, 6.0]]), mesh, [Shard(0)])
    out["tiny"] = core_utils.get_full_tensor_if_necessary(tiny).tolist()
    replicated = distribute_tensor(full, mesh, [Replicate()])
    out["replicated"] = core_utils.get_full_tensor_if_necessary(replicated).shape
    group = core_utils.get_data_parallel_group_if_dtensor(sharded)
    out["group_ranks"] = dist.get_process_group_ranks(group)
    assert core_utils.get_data_parallel_group_if_dtensor(sharded, group) is group
    other = _group([0, 1])
    try:
        core_utils.get_data_parallel_group_if_dtensor(sharded, other)
        out["mismatch"] = None
    except ValueError as exc:
        out["mismatch"] = str(exc)


def _wgrad(rank: int, out: dict[str, Any]) -> None:
    torch.manual_seed(1)
    # The same full activations and grads on both ranks; each rank holds its sequence shard.
    full_acts = [torch.randn(4, 2, 6) for _ in range(3)]
    grads = [torch.randn(4, 2, 5) for _ in range(3)]  # [s_full, b, h_out]
    shards = [a.chunk(2, dim=0)[rank].contiguous() for a in full_acts]
    weight = torch.nn.Parameter(torch.zeros(5, 6))
    weight.main_grad = torch.zeros(5, 6)  # type: ignore[attr-defined]
    core_utils.drain_embedding_wgrad_compute(_Config(), shards, list(grads), weight, None)
    expected = sum(
        g.reshape(-1, 5).t() @ a.reshape(-1, 6) for a, g in zip(full_acts, grads, strict=True)
    )
    out["wgrad_error"] = (weight.main_grad - expected).abs().max().item()  # type: ignore[attr-defined]
    out["buffers_drained"] = shards == []


def _logging_and_cp(rank: int, out: dict[str, Any]) -> None:
    handler = _ListHandler()
    log = logging.getLogger(f"core_utils.test.rank{rank}")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    core_utils.log_single_rank(log, logging.INFO, "only rank 1", rank=1)
    core_utils.log_single_rank(log, logging.INFO, "only rank 0")
    # Two pipeline "stages" of one rank each: both are the first rank of their stage.
    singles = [_group([r]) for r in range(2)]
    core_utils.log_on_each_pipeline_stage(
        log, logging.INFO, "stage head", tp_group=singles[rank], dp_cp_group=singles[rank]
    )
    # Both ranks in one data-parallel group: only DP rank 0 logs.
    both = _group([0, 1])
    core_utils.log_on_each_pipeline_stage(
        log, logging.INFO, "dp head", tp_group=singles[rank], dp_cp_group=both
    )
    with pytest.raises(ValueError, match="parallel_state is not"):
        core_utils.log_on_each_pipeline_stage(log, logging.INFO, "no groups")
    out["logged"] = handler.messages
    tokens = torch.arange(8).unsqueeze(0)
    out["cp"] = core_utils.get_batch_on_this_cp_rank({"tokens": tokens}, cp_group=both)[
        "tokens"
    ].tolist()
    symmetric = core_utils.GlobalSymmetricMemoryBuffer(1, both)
    out["symmetric"] = symmetric.maybe_get_tensor((2,), torch.float32)


def _on_ranks(rank: int, world_size: int) -> dict[str, Any]:
    from core_utils.distributed import (
        any_rank,
        broadcast_from_rank0,
        gather_from_every_rank,
        global_rank,
        global_world_size,
    )

    # The process group, not the launcher's environment, answers once it exists.
    out: dict[str, Any] = {"global": (global_rank(), global_world_size())}
    out["broadcast"] = broadcast_from_rank0({"from": rank, "prompts": ["a", None]})
    out["gathered"] = gather_from_every_rank({"from": rank})
    out["any"] = (any_rank(rank == 1), any_rank(False), any_rank(True))
    out["global_launcher"] = (
        global_rank(launcher_fallback=True),
        global_world_size(launcher_fallback=True),
    )
    _process_groups(rank, out)
    _param_hashes(rank, out)
    _dtensors(rank, out)
    _wgrad(rank, out)
    _logging_and_cp(rank, out)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_distributed_helpers_on_two_gloo_ranks() -> None:
    results = run_distributed(_on_ranks, 2, timeout=130)
    for rank, out in enumerate(results):
        assert out["global"] == out["global_launcher"] == (rank, 2)
        assert out["pg"] == (2, rank, 0, 1, 0)
        assert out["broadcast"] == {"from": 0, "prompts": ["a", None]}
        assert out["gathered"] == [{"from": 0}, {"from": 1}]
        assert out["any"] == (True, False, True)  # rank 1's flag reaches rank 0
        # Identical replicas match; a drifted replica is detected.
        assert out["same"] is True and out["same_cross"] is True
        assert out["diverged_cross"] is False
        assert out["local"] == torch.arange(8.0).reshape(4, 2)[2 * rank : 2 * rank + 2].tolist()
        assert out["if_necessary"] == out["local"]
        assert out["tiny"] == [[5.0, 6.0]]
        assert out["replicated"] == (4, 2)
        assert out["group_ranks"] == [0, 1]
        assert out["mismatch"] is not None and "is not data_parallel_group" in out["mismatch"]
        assert out["wgrad_error"] < 1e-5 and out["buffers_drained"]
        assert out["symmetric"] is None or torch.cuda.is_available()
    assert results[0]["solo"] == (1, 0, 0) and results[1]["solo"] == (1, 0, 1)
    # Rank 0 compares with itself; rank 1 (the drifted one) does not match DP rank 0.
    assert results[0]["diverged"] is True and results[1]["diverged"] is False
    assert results[0]["logged"] == ["only rank 0", "stage head", "dp head"]
    assert results[1]["logged"] == ["only rank 1", "stage head"]
    # cp=2 over 8 tokens: rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2.
    assert results[0]["cp"] == [[0, 1, 6, 7]] and results[1]["cp"] == [[2, 3, 4, 5]]


def test_broadcast_from_rank0_without_a_process_group_returns_the_value() -> None:
    from core_utils.distributed import any_rank, broadcast_from_rank0, gather_from_every_rank

    value = {"prompts": ["a"]}
    assert broadcast_from_rank0(value) is value
    assert gather_from_every_rank(value) == [value]
    assert any_rank(True) is True and any_rank(False) is False
