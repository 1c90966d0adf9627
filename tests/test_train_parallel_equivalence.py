"""Through the real command: one process, DP=2 and TP=2 under torchrun train the same model.

``python -m bridge.train`` runs the default recipe (shrunk by overrides) bare on one process
and under ``torchrun --nproc-per-node=2`` with data parallelism 2 and with tensor parallelism
2; all three see the same global batch per step, so the per-step losses (read from
``--metrics-file``, full precision) agree within 1e-5 in fp32. The engine is megatron-core's
DDP, optimizer and schedule, on CPU under ``core_utils.cuda_emulation``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bridge.train.metrics import read_metrics_file
from core_utils.testing import run_torchrun

ITERS = 8
OVERRIDES = [
    "--no-print-config",
    f"train.train_iters={ITERS}",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.eval_interval=null",
    "train.eval_iters=0",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.seq_length=64",
    "logger.log_interval=4",
    "scheduler.lr_warmup_iters=2",
]


def _losses(path: Path) -> list[float]:
    records = [r for r in read_metrics_file(path) if "lm loss" in r]
    assert [r["step"] for r in records] == list(range(1, ITERS + 1))
    return [r["lm loss"] for r in records]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(1300)
def test_dp2_and_tp2_match_one_process(tmp_path: Path) -> None:
    overrides = OVERRIDES
    single = subprocess.run(
        [
            sys.executable,
            "-m",
            "bridge.train",
            "--metrics-file",
            str(tmp_path / "single.jsonl"),
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=tmp_path,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    reference = _losses(tmp_path / "single.jsonl")

    for name, extra in (("dp2", []), ("tp2", ["model.tensor_model_parallel_size=2"])):
        proc = run_torchrun(
            "bridge.train",
            2,
            ["--metrics-file", str(tmp_path / f"{name}.jsonl"), *overrides, *extra],
            torchrun_args=["-m"],
            timeout=400,
            cwd=tmp_path,
        )
        assert proc.returncode == 0
        losses = _losses(tmp_path / f"{name}.jsonl")
        for step, (got, want) in enumerate(zip(losses, reference, strict=True), start=1):
            assert abs(got - want) <= 1e-5, f"{name} step {step}: {got} vs {want}"
    assert reference[-1] < reference[0]
