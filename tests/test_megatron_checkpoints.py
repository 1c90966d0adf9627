"""Checkpoints on megatron-core's engine on CPU: exact resume, cross-layout resume, refusals.

Every run is ``pretrain`` (megatron-core DDP, optimizer and pipeline schedules under
core-utils' CUDA emulation). Same-layout runs use dropout, so the
RNG state (torch's generator and megatron's tensor-parallel RNG tracker) matters. One
process group of two forked ranks runs every job of a test in sequence, so the cost of
starting processes is paid once.

Exactness: a run of 20 iterations saves at 10 and 20; a second run loads the checkpoint of
10 (``checkpoint.ckpt_step``) into a new directory and trains 11-20. Its per-step losses
and gradient norms equal the uninterrupted run's bit for bit: model, distributed-optimizer
state, scheduler, RNG and data position are all restored.

Cross-layout: the checkpoint of 10 saved with PP=2 is loaded with DP=2 and the losses of
11-20 match the saved layout's own continuation within 1e-5 relative (fp32; the layouts sum
in different orders, so not bit for bit), also with the distributed optimizer switched on at
the resume (per-parameter state converted). The resume matrix across TP, PP, VPP, EP and
DP sizes is in tests/test_megatron_engine_layouts.py.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest

from bridge.config import CheckpointConfig, DistributedDataParallelConfig, LoggerConfig
from bridge.train import forward_step, pretrain
from bridge.train.metrics import read_metrics_file
from bridge.train.testing import (
    tiny_config_container,
    tiny_gpt_provider,
    tiny_optimizer_config,
    tiny_train_config,
)
from core_utils.testing import run_distributed

ITERS, SAVE_AT = 20, 10


def _config(job: dict[str, Any]) -> Any:
    import torch

    layout = job.get("layout", {})
    dropout = 0.1 if job.get("dropout", True) else 0.0
    model = tiny_gpt_provider(
        num_layers=4,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        pipeline_dtype=torch.float32,
        **layout,
    )
    if layout.get("virtual_pipeline_model_parallel_size"):
        model.batch_p2p_comm = False
        model.overlap_p2p_comm = True
    distributed = bool(job.get("distributed_optimizer", False))
    train = tiny_train_config(train_iters=ITERS, global_batch_size=8, micro_batch_size=1)
    return tiny_config_container(
        train=train,
        model=model,
        optimizer=tiny_optimizer_config(use_distributed_optimizer=distributed),
        ddp=DistributedDataParallelConfig(
            use_distributed_optimizer=distributed, overlap_grad_reduce=distributed
        ),
        logger=LoggerConfig(log_interval=1),
        checkpoint=CheckpointConfig(
            save=job["save"],
            save_interval=SAVE_AT,
            load=job.get("load"),
            ckpt_step=job.get("ckpt_step"),
            exit_on_missing_checkpoint=job.get("load") is not None,
            load_rng=job.get("load_rng", True),
        ),
    )


def _jobs(rank: int, world: int, jobs: list[dict[str, Any]]) -> list[Any]:
    """Run each job's ``pretrain`` in turn; their exit codes. The trainer's warnings go to
    ``<metrics>.warnings.<rank>``."""
    codes = []
    for job in jobs:
        handler = logging.FileHandler(f"{job['metrics']}.warnings.{rank}", encoding="utf-8")
        handler.setLevel(logging.WARNING)
        logging.getLogger("bridge.train").addHandler(handler)
        try:
            codes.append(
                pretrain(_config(job), forward_step, metrics_file=f"{job['metrics']}.{rank}")
            )
        finally:
            logging.getLogger("bridge.train").removeHandler(handler)
            handler.close()
    return codes


def _records(path: Path) -> dict[int, tuple[float, Any]]:
    """``{step: (lm loss, grad norm)}`` from a metrics file."""
    records = {}
    for record in read_metrics_file(path):
        if "lm loss" in record:
            records[int(record["step"])] = (record["lm loss"], record.get("grad-norm"))
    return records


def _last_rank_records(metrics: Path, world: int) -> dict[int, tuple[float, Any]]:
    return _records(Path(f"{metrics}.{world - 1}"))


def _assert_close(resumed: dict[int, Any], reference: dict[int, Any], rtol: float) -> None:
    assert sorted(resumed) == list(range(SAVE_AT + 1, ITERS + 1)), sorted(resumed)
    for step, (loss, norm) in resumed.items():
        ref_loss, ref_norm = reference[step]
        if rtol == 0:
            assert (loss, norm) == (ref_loss, ref_norm), f"step {step}"
        else:
            assert math.isclose(loss, ref_loss, rel_tol=rtol), f"step {step}: {loss} {ref_loss}"
            assert math.isclose(norm, ref_norm, rel_tol=rtol * 10), f"step {step}"


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resume_is_exact_with_pp2_and_with_dp2_distributed_optimizer_and_across_layouts(
    tmp_path: Path,
) -> None:
    pp2 = {"pipeline_model_parallel_size": 2}
    jobs = [
        {"save": str(tmp_path / "pp2"), "metrics": str(tmp_path / "pp2"), "layout": pp2},
        {
            "save": str(tmp_path / "pp2-resumed"),
            "metrics": str(tmp_path / "pp2-resumed"),
            "layout": pp2,
            "load": str(tmp_path / "pp2"),
            "ckpt_step": SAVE_AT,
        },
        {
            "save": str(tmp_path / "dp2"),
            "metrics": str(tmp_path / "dp2"),
            "distributed_optimizer": True,
        },
        {
            "save": str(tmp_path / "dp2-resumed"),
            "metrics": str(tmp_path / "dp2-resumed"),
            "distributed_optimizer": True,
            "load": str(tmp_path / "dp2"),
            "ckpt_step": SAVE_AT,
        },
        # PP=2 (no distributed optimizer) saved, DP=2 with the distributed optimizer loaded;
        # without dropout (the RNG is per layout and not restored across layouts).
        {
            "save": str(tmp_path / "pp2-nodrop"),
            "metrics": str(tmp_path / "pp2-nodrop"),
            "layout": pp2,
            "dropout": False,
        },
        {
            "save": str(tmp_path / "pp2-as-dp2"),
            "metrics": str(tmp_path / "pp2-as-dp2"),
            "dropout": False,
            "load": str(tmp_path / "pp2-nodrop"),
            "ckpt_step": SAVE_AT,
        },
        # Per-parameter optimizer state into the distributed optimizer (converted).
        {
            "save": str(tmp_path / "pp2-as-dp2-distopt"),
            "metrics": str(tmp_path / "pp2-as-dp2-distopt"),
            "distributed_optimizer": True,
            "dropout": False,
            "load": str(tmp_path / "pp2-nodrop"),
            "ckpt_step": SAVE_AT,
        },
    ]
    outcomes = run_distributed(_jobs, 2, jobs, timeout=600)
    for rank_outcomes in outcomes:
        assert rank_outcomes == [0] * len(jobs)
    pp2_ref = _last_rank_records(tmp_path / "pp2", 2)
    dp2_ref = _last_rank_records(tmp_path / "dp2", 2)
    assert sorted(pp2_ref) == sorted(dp2_ref) == list(range(1, ITERS + 1))
    _assert_close(_last_rank_records(tmp_path / "pp2-resumed", 2), pp2_ref, rtol=0)
    _assert_close(_last_rank_records(tmp_path / "dp2-resumed", 2), dp2_ref, rtol=0)
    nodrop_ref = _last_rank_records(tmp_path / "pp2-nodrop", 2)
    _assert_close(_last_rank_records(tmp_path / "pp2-as-dp2", 2), nodrop_ref, rtol=1e-5)
    # One warning for the RNG state left behind by the layout change, naming both layouts
    # and the reseed pretrain does.
    warnings = (tmp_path / "pp2-as-dp2.warnings.0").read_text(encoding="utf-8").splitlines()
    rng_lines = [line for line in warnings if "RNG" in line or "seed" in line]
    assert len(rng_lines) == 1, warnings
    assert "(TP1 PP2 CP1 DP1 EP1 ETP1 -> TP1 PP1 CP1 DP2 EP1 ETP1)" in rng_lines[0]
    assert f"reseeded from rng.seed=1234 and iteration {SAVE_AT}" in rng_lines[0]
    _assert_close(_last_rank_records(tmp_path / "pp2-as-dp2-distopt", 2), nodrop_ref, rtol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(2400)
def test_cross_layout_resume_at_four_ranks(tmp_path: Path) -> None:
    """TP=2 x PP=2 saved with per-parameter optimizer state, loaded under DP=4 and under one
    process; DP=4 saved with the distributed optimizer, loaded under DP=2 and under TP=2 x
    PP=2 (fully reshardable state); each continuation matches the saved layout's own within
    1e-5 relative.

    Without dropout: the RNG state is per layout and not restored across layouts.
    """
    tp2pp2 = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}

    def job(name: str, **fields: Any) -> dict[str, Any]:
        paths = {"save": str(tmp_path / name), "metrics": str(tmp_path / name)}
        return {**paths, "dropout": False, **fields}

    four_ranks = [
        job("tp2pp2", layout=tp2pp2),
        job("tp2pp2-as-dp4", load=str(tmp_path / "tp2pp2"), ckpt_step=SAVE_AT),
        job("dp4-distopt", distributed_optimizer=True),
        job(
            "dp4-as-tp2pp2",
            layout=tp2pp2,
            distributed_optimizer=True,
            load=str(tmp_path / "dp4-distopt"),
            ckpt_step=SAVE_AT,
        ),
    ]
    for outcomes in run_distributed(_jobs, 4, four_ranks, timeout=2000):
        assert outcomes == [0, 0, 0, 0], outcomes
    two_ranks = [
        job(
            "dp4-as-dp2",
            distributed_optimizer=True,
            load=str(tmp_path / "dp4-distopt"),
            ckpt_step=SAVE_AT,
        )
    ]
    assert run_distributed(_jobs, 2, two_ranks, timeout=900) == [[0], [0]]
    one_rank = [job("tp2pp2-as-single", load=str(tmp_path / "tp2pp2"), ckpt_step=SAVE_AT)]
    assert run_distributed(_jobs, 1, one_rank, timeout=900) == [[0]]

    tp2pp2_ref = _last_rank_records(tmp_path / "tp2pp2", 4)
    dp4_ref = _last_rank_records(tmp_path / "dp4-distopt", 4)
    assert sorted(tp2pp2_ref) == sorted(dp4_ref) == list(range(1, ITERS + 1))
    _assert_close(_last_rank_records(tmp_path / "tp2pp2-as-dp4", 4), tp2pp2_ref, rtol=1e-5)
    _assert_close(_last_rank_records(tmp_path / "tp2pp2-as-single", 1), tp2pp2_ref, rtol=1e-5)
    _assert_close(_last_rank_records(tmp_path / "dp4-as-dp2", 2), dp4_ref, rtol=1e-5)
    _assert_close(_last_rank_records(tmp_path / "dp4-as-tp2pp2", 4), dp4_ref, rtol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(1200)
def test_dropout_after_a_layout_change(tmp_path: Path) -> None:
    """PP=2 with dropout saved at 10, continued under DP=2: the saved generator states are per
    rank and not restored, the generators are reseeded from the seed and iteration 10. Two
    such resumes train identically; a resume keeping its own seeds (``load_rng=False``: the
    fresh-start state, whose masks a fresh DP=2 run draws from its first step) differs."""
    pp2 = {"pipeline_model_parallel_size": 2}

    def job(name: str, **fields: Any) -> dict[str, Any]:
        return {"save": str(tmp_path / name), "metrics": str(tmp_path / name), **fields}

    resumed = {"load": str(tmp_path / "pp2"), "ckpt_step": SAVE_AT}
    jobs = [
        job("pp2", layout=pp2),
        job("pp2-as-dp2", **resumed),
        job("pp2-as-dp2-again", **resumed),
        job("pp2-as-dp2-own-seeds", load_rng=False, **resumed),
    ]
    assert run_distributed(_jobs, 2, jobs, timeout=1000) == [[0] * 4] * 2
    first = _last_rank_records(tmp_path / "pp2-as-dp2", 2)
    assert sorted(first) == list(range(SAVE_AT + 1, ITERS + 1))
    assert first == _last_rank_records(tmp_path / "pp2-as-dp2-again", 2)
    own_seeds = _last_rank_records(tmp_path / "pp2-as-dp2-own-seeds", 2)
    assert sorted(own_seeds) == sorted(first)
    assert any(first[step][0] != own_seeds[step][0] for step in first), "not reseeded"
