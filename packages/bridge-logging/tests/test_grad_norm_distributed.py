"""Four gloo ranks: the global gradient norm equals the true norm under TP, PP and EP.

Each layout hands every rank its part of a model whose full gradients are known, so the
expected norm is computed here in one process from the full tensors. One process group is
spawned for all layouts (launches are the expensive part).

* dense: tensor parallel 2 x pipeline parallel 2 with two virtual chunks per rank, a tied
  embedding whose second copy is ``shared=True``, and a chunk passed twice;
* MoE on that layout: expert tensor parallel 1, expert parallel 2 inside each stage, so
  the expert parameters of the two tensor-parallel ranks are different experts;
* MoE with expert data parallelism: dense data parallel 4 (model-parallel groups of one
  rank), expert parallel 2 x expert data parallel 2, so expert norms are summed over a
  different group than dense ones.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from bridge.logging import report_l2_norm_grad
from core_utils.testing import run_distributed

ROWS, COLS = 4, 8  # a dense TP-sharded weight; each TP rank holds ROWS // 2 rows
EMBED_ROWS = 6


def _full_grads() -> dict[str, torch.Tensor]:
    """Every gradient of every layout, whole (as one process would hold them)."""
    g = torch.Generator().manual_seed(0)
    grads = {"embedding": torch.randn(EMBED_ROWS, COLS, generator=g)}
    for v in range(4):  # virtual pipeline stages
        grads[f"weight{v}"] = torch.randn(ROWS, COLS, generator=g)
        grads[f"norm{v}"] = torch.randn(COLS, generator=g)
    for e in range(4):  # experts
        grads[f"expert{e}.weight"] = torch.randn(ROWS, COLS, generator=g)
        grads[f"expert{e}.bias"] = torch.randn(ROWS, generator=g)
    return grads


def _norm(grads: dict[str, torch.Tensor], names: list[str]) -> float:
    return math.sqrt(sum(float(grads[n].double().pow(2).sum()) for n in names))


def _param(grad: torch.Tensor, **attributes: Any) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.zeros_like(grad))
    param.grad = grad.clone()
    for name, value in attributes.items():
        setattr(param, name, value)
    return param


def _rows(tensor: torch.Tensor, tp_rank: int) -> torch.Tensor:
    size = tensor.shape[0] // 2
    return tensor[tp_rank * size : (tp_rank + 1) * size]


class _Chunk(torch.nn.Module):
    """A model chunk; declares the ``pg_collection`` a test may attach, as megatron models
    carry it (torch types undeclared module attributes as tensors or modules)."""

    pg_collection: SimpleNamespace


def _dense_chunk(v: int, tp_rank: int, grads: dict[str, torch.Tensor]) -> _Chunk:
    """Virtual stage ``v`` as tensor-parallel rank ``tp_rank`` holds it."""
    chunk = _Chunk()
    chunk.weight = _param(_rows(grads[f"weight{v}"], tp_rank), tensor_model_parallel=True)
    chunk.norm = _param(grads[f"norm{v}"])
    if v == 0:
        chunk.embedding = _param(_rows(grads["embedding"], tp_rank), tensor_model_parallel=True)
    if v == 3:  # the output layer tied to the embedding: same gradient, counted once
        chunk.output = _param(
            _rows(grads["embedding"], tp_rank), tensor_model_parallel=True, shared=True
        )
    return chunk


def _expert(e: int, grads: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Expert ``e`` as megatron-core marks it: ``allreduce=False``, the linear weight a TP
    shard of its expert tensor-parallel group (here of one rank), the bias not."""
    expert = torch.nn.Module()
    expert.weight = _param(grads[f"expert{e}.weight"], allreduce=False, tensor_model_parallel=True)
    expert.bias = _param(grads[f"expert{e}.bias"], allreduce=False)
    return expert


def _error(fn: Any) -> str | None:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def _ranks(rank: int, world: int) -> dict[str, Any]:
    assert world == 4
    grads = _full_grads()
    # Every rank creates every group, in the same order (new_group is collective).
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    singles = [dist.new_group([r]) for r in range(world)]
    world_copy = dist.new_group(list(range(world)))
    ep_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    stage, tp_rank = divmod(rank, 2)
    tp, pp = tp_groups[stage], pp_groups[tp_rank]
    out: dict[str, Any] = {}

    # Dense TP2 x PP2, interleaved: stage s holds virtual stages s and s + 2.
    first, second = _dense_chunk(stage, tp_rank, grads), _dense_chunk(stage + 2, tp_rank, grads)
    # Only the model-parallel group: which ranks are TP replicas is unknown.
    out["mp_only_error"] = _error(
        lambda: report_l2_norm_grad([first, second], mp_group=dist.group.WORLD)
    )
    out["tp_only_error"] = _error(lambda: report_l2_norm_grad([first, second], tp_group=tp))
    out["explicit"] = report_l2_norm_grad(
        [first, second, first], mp_group=dist.group.WORLD, tp_group=tp
    )
    first.pg_collection = SimpleNamespace(mp=dist.group.WORLD, tp=tp, pp=pp)
    out["from_model"] = report_l2_norm_grad([first, second, first])

    # MoE on the same layout: ETP 1, EP 2 inside each stage, expert 2 * stage + tp_rank.
    moe = torch.nn.Module()
    moe.dense = _dense_chunk(stage, tp_rank, grads)
    moe.expert = _expert(2 * stage + tp_rank, grads)
    moe_pg = SimpleNamespace(
        mp=dist.group.WORLD, tp=tp, pp=pp, expt_tp=singles[rank], tp_ep_pp=world_copy
    )
    out["moe"] = report_l2_norm_grad(moe, pg_collection=moe_pg)
    no_expert_group = SimpleNamespace(mp=dist.group.WORLD, tp=tp, pp=pp, expt_tp=singles[rank])
    out["moe_error"] = _error(lambda: report_l2_norm_grad(moe, pg_collection=no_expert_group))

    # Dense DP 4 (model parallel of one rank), experts EP 2 x expert DP 2.
    replicated = torch.nn.Module()
    replicated.norm = _param(grads["norm0"])
    replicated.expert = _expert(rank % 2, grads)
    ep = ep_groups[rank // 2]
    dp_pg = SimpleNamespace(mp=singles[rank], tp=singles[rank], expt_tp=singles[rank], tp_ep_pp=ep)
    out["ep_dp"] = report_l2_norm_grad(replicated, pg_collection=dp_pg)
    out["ep_dp_explicit"] = report_l2_norm_grad(
        replicated, mp_group=singles[rank], tp_group=singles[rank], expert_mp_group=ep
    )
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_global_norm_is_the_true_norm_under_tp_pp_and_ep() -> None:
    results = run_distributed(_ranks, 4, timeout=200)
    grads = _full_grads()
    dense_names = ["embedding"] + [f"{kind}{v}" for v in range(4) for kind in ("weight", "norm")]
    dense = _norm(grads, dense_names)
    experts = [f"expert{e}.{p}" for e in range(4) for p in ("weight", "bias")]
    moe_names = [f"{kind}{s}" for s in range(2) for kind in ("weight", "norm")] + ["embedding"]
    moe_names += experts
    ep_dp_names = ["norm0"] + [f"expert{e}.{p}" for e in range(2) for p in ("weight", "bias")]
    for rank, r in enumerate(results):
        stage, tp_rank = divmod(rank, 2)
        for key in ("explicit", "from_model"):
            report = r[key]
            assert report["l2_norm/grad/global"] == pytest.approx(dense, rel=1e-6), (rank, key)
            # Per parameter: TP shards summed over the TP group, replicas as they are.
            assert report["l2_norm/grad/chunk0.weight"] == pytest.approx(
                _norm(grads, [f"weight{stage}"]), rel=1e-6
            )
            assert report["l2_norm/grad/chunk1.weight"] == pytest.approx(
                _norm(grads, [f"weight{stage + 2}"]), rel=1e-6
            )
            assert report["l2_norm/grad/chunk1.norm"] == pytest.approx(
                _norm(grads, [f"norm{stage + 2}"]), rel=1e-6
            )
            # The chunk passed a second time adds nothing.
            assert not [k for k in report if k.startswith("l2_norm/grad/chunk2.")]
        assert r["mp_only_error"] is not None and "pass tp_group=" in r["mp_only_error"]
        assert "model-parallel group has 4 ranks" in r["mp_only_error"]
        assert r["tp_only_error"] is not None and "pass mp_group=" in r["tp_only_error"]

        # The MoE layout: the embedding is only on stage 0, its copy is absent here.
        moe = r["moe"]
        assert moe["l2_norm/grad/global"] == pytest.approx(_norm(grads, moe_names), rel=1e-6)
        own_expert = 2 * stage + tp_rank
        # An expert's weight is its own: not summed with the other TP rank's expert.
        assert moe["l2_norm/grad/expert.weight"] == pytest.approx(
            _norm(grads, [f"expert{own_expert}.weight"]), rel=1e-6
        )
        assert moe["l2_norm/grad/dense.weight"] == pytest.approx(
            _norm(grads, [f"weight{stage}"]), rel=1e-6
        )
        assert r["moe_error"] is not None and "expert_mp_group=" in r["moe_error"]
        assert "tp_ep_pp" in r["moe_error"]

        for key in ("ep_dp", "ep_dp_explicit"):
            report = r[key]
            assert report["l2_norm/grad/global"] == pytest.approx(
                _norm(grads, ep_dp_names), rel=1e-6
            ), (rank, key)
            assert report["l2_norm/grad/expert.bias"] == pytest.approx(
                _norm(grads, [f"expert{rank % 2}.bias"]), rel=1e-6
            )
