"""Two gloo ranks: TP-sharded gradient norms, PP memory reduction, training_log on the last rank.

One process group is spawned and several things are checked in it (launches are the
expensive part). The MLflow settings check needs the mlflow extra and has its own launch,
so a venv without it still runs everything else.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from bridge.config import LoggerConfig, TrainingConfig
from bridge.config.testing import tiny_container
from bridge.logging import (
    BackendSettings,
    build_metric_writers,
    reduce_max_memory_across_pp_group,
    report_l2_norm_grad,
    training_log,
)
from bridge.logging._dist import reduce_max_stat
from core_utils import Timers
from core_utils.testing import run_distributed

OUT, IN = 6, 8


def _full_grads() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "weight": torch.randn(OUT, IN, generator=g),
        "bias": torch.randn(OUT, generator=g),
        "norm": torch.randn(IN, generator=g),
        "tied": torch.randn(IN, generator=g),
    }


class _TPBlock(torch.nn.Module):
    """A column-parallel linear (rows split across ranks) plus replicated parameters."""

    pg_collection: SimpleNamespace  # attached by a test, as megatron models carry it

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        grads = _full_grads()
        rows = slice(rank * OUT // world, (rank + 1) * OUT // world)
        self.weight = torch.nn.Parameter(torch.zeros(OUT // world, IN))
        self.bias = torch.nn.Parameter(torch.zeros(OUT // world))
        self.norm = torch.nn.Parameter(torch.zeros(IN))
        self.tied = torch.nn.Parameter(torch.zeros(IN))
        for name in ("weight", "bias"):
            param = getattr(self, name)
            param.tensor_model_parallel = True
            param.grad = grads[name][rows].clone()
        self.norm.grad = grads["norm"].clone()
        self.tied.grad = grads["tied"].clone()


def _ranks(rank: int, world: int, tb_dir: str) -> dict[str, Any]:
    torch.manual_seed(0)
    group = dist.group.WORLD
    result: dict[str, Any] = {}

    # Gradient norms: TP shards summed over the group, replicas counted once, and a
    # second (shared=True) copy of a tied parameter on the last rank left out.
    block = _TPBlock(rank, world)
    tied_copy = torch.nn.Parameter(torch.zeros(IN))
    tied_copy.shared = True  # type: ignore[attr-defined]
    tied_copy.grad = _full_grads()["tied"].clone()
    holder = torch.nn.Module()
    if rank == world - 1:
        holder.tied_copy = tied_copy
    result["explicit"] = report_l2_norm_grad([block, holder], mp_group=group, tp_group=group)
    block.pg_collection = SimpleNamespace(mp=group, tp=group)  # as megatron models carry it
    result["from_model"] = report_l2_norm_grad(block)

    # Memory: MAX over the pipeline group in one all-reduce, counters stay int.
    report = {
        "peak_allocated_mem": 1.0 + rank,
        "alloc_retries": 5 - 3 * rank,
        "current_active_mem": 0.25,
    }
    result["memory"] = reduce_max_memory_across_pp_group(report, group)
    singles = [dist.new_group([r]) for r in range(world)]
    result["memory_single_is_same"] = (
        reduce_max_memory_across_pp_group(report, singles[rank]) is report
    )

    # Learning rate: None on ranks without parameters, the others' value wins.
    result["lr"] = reduce_max_stat(None if rank == 0 else 2e-4, group)
    result["lr_none"] = reduce_max_stat(None, group)

    # training_log on both ranks: only the last one writes and prints.
    cfg = tiny_container(
        train=TrainingConfig(
            micro_batch_size=2, global_batch_size=4, train_iters=4, eval_interval=None
        ),
        logger=LoggerConfig(
            log_interval=2,
            tensorboard_dir=tb_dir,
            log_world_size_to_tensorboard=True,
            log_timers_to_tensorboard=True,
            log_memory_to_tensorboard=True,
            timing_log_level=1,
        ),
    )
    cfg.validate(world_size=world)
    assert cfg.logger is not None
    writers = build_metric_writers(cfg.logger, rank=rank, world_size=world)
    result["enabled"] = writers.enabled
    timers = Timers(1, "max")
    timers("interval-time", log_level=0).start()
    state = SimpleNamespace(
        cfg=cfg,
        train_state=SimpleNamespace(
            step=0,
            consumed_train_samples=0,
            skipped_train_samples=0,
            consumed_valid_samples=0,
            floating_point_operations_so_far=0.0,
        ),
        timers=timers,
        metric_writers=writers,
        start_time=0.0,
    )
    pg = SimpleNamespace(mp=group, pp=group, tp=group, dp=group)
    total: dict[str, Any] = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for step in range(1, 5):
            fb = timers("forward-backward", log_level=1)
            fb.start()
            fb.stop()
            state.train_state.step = step
            state.train_state.consumed_train_samples += 4
            training_log(
                {"lm loss": torch.tensor(float(step))},
                total,
                None if rank == 0 else 1e-3,
                None,
                1.0,
                False,
                0,
                None,
                None,
                None,
                cfg,
                state,
                [],
                [block],
                pg_collection=pg,
            )
    writers.close()
    result["stdout"] = out.getvalue()

    # A writer that fails to build on the last rank fails every rank: here TensorBoard,
    # whose directory would have to be created inside a regular file.
    blocker = Path(tb_dir).parent / "not-a-directory"
    if rank == world - 1:
        blocker.write_text("")
    dist.barrier()
    try:
        build_metric_writers(
            LoggerConfig(tensorboard_dir=str(blocker / "tb")), rank=rank, world_size=world
        )
    except Exception as exc:
        result["build_error"] = f"{type(exc).__name__}: {exc}"
    return result


def _mlflow_without_uri(rank: int, world: int) -> dict[str, Any]:
    # A setting every rank can check (no tracking URI) fails every rank before building.
    result: dict[str, Any] = {}
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    try:
        build_metric_writers(
            LoggerConfig(),
            rank=rank,
            world_size=world,
            backend_settings=BackendSettings(mlflow_experiment="e"),
        )
    except Exception as exc:
        result["uri_error"] = f"{type(exc).__name__}: {exc}"
    return result


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_two_ranks(kit: Any, tmp_path: Path) -> None:
    results = run_distributed(_ranks, 2, str(tmp_path / "tb"), timeout=150)
    grads = _full_grads()
    expected_global = math.sqrt(
        sum(float(grads[k].pow(2).sum()) for k in ("weight", "bias", "norm", "tied"))
    )
    for r in results:
        assert r["explicit"]["l2_norm/grad/global"] == pytest.approx(expected_global, rel=1e-6)
        assert r["from_model"]["l2_norm/grad/global"] == pytest.approx(expected_global, rel=1e-6)
        assert r["explicit"]["l2_norm/grad/chunk0.weight"] == pytest.approx(
            float(grads["weight"].norm()), rel=1e-6
        )
        assert r["explicit"]["l2_norm/grad/chunk0.norm"] == pytest.approx(
            float(grads["norm"].norm()), rel=1e-6
        )
        assert r["memory"] == {
            "peak_allocated_mem": 2.0,
            "alloc_retries": 5,
            "current_active_mem": 0.25,
        }
        assert isinstance(r["memory"]["alloc_retries"], int)
        assert r["memory_single_is_same"]
        assert r["lr"] == pytest.approx(2e-4)
        assert r["lr_none"] is None
    # The last rank alone holds writers, prints the line and the timers.
    assert [r["enabled"] for r in results] == [False, True]
    assert results[0]["stdout"] == ""
    printed = results[1]["stdout"]
    assert printed.count("consumed samples") == 2
    assert "learning rate: 1.000000E-03" in printed
    assert "lm loss: 1.500000E+00" in printed and "lm loss: 3.500000E+00" in printed
    assert "forward-backward" in printed
    tags = kit.read_tensorboard(tmp_path / "tb")
    assert tags["world-size"][0][1] == 2.0
    assert "forward-backward-time" in tags
    assert [s for s, _ in tags["lm loss"]] == [1, 2, 3, 4]
    assert results[1]["build_error"].startswith(("NotADirectoryError", "FileExistsError"))
    assert results[0]["build_error"] == (
        "RuntimeError: building the metric writers failed on rank 1; see its error"
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_mlflow_without_tracking_uri_fails_every_rank() -> None:
    pytest.importorskip("mlflow")  # without the package, the missing extra is the error
    results = run_distributed(_mlflow_without_uri, 2, timeout=90)
    for r in results:
        assert r["uri_error"].startswith("ValueError: MLflow logging is on")
        assert "LoggerConfig.mlflow_tracking_uri" in r["uri_error"]
