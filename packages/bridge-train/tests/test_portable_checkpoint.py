"""Checkpoints saved by the retired portable engine still load, optimizer state included.

``tests/data/portable_checkpoint`` holds real checkpoints of the portable engine (fp32, and
bf16 with fp32 main parameters) at iteration 3 of a 6-iteration run, produced on main before
the engine was deleted, and that run's metrics (see its README). Resuming them on
megatron-core's engine converts the portable optimizer's state (Adam moments, step, fp32
main parameters) and continues the run: iterations 4-6 give the portable run's own losses
and grad norms (bounds at ``TOL``). If the optimizer restarted instead, iteration 5's loss
would be 3e-3 off (the first update after a fresh Adam). The same holds when they are resumed
with megatron's distributed optimizer (the per-parameter state is converted). Also checked on
the same checkpoint: a flipped byte is refused as damaged (nothing loaded).

One forked 1-rank group runs every case (``pretrain``, as ``bridge-train`` does).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from bridge.config import load_config
from bridge.train import pretrain
from bridge.train.checkpointing import CheckpointError
from bridge.train.metrics import read_metrics_file
from bridge.train.recipes import recipe_path
from core_utils.testing import run_distributed

DATA = Path(__file__).resolve().parent / "data" / "portable_checkpoint"

# The overrides the checkpoints were produced with (README.md), without the engine.
OVERRIDES = [
    "train.train_iters=6",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.eval_interval=null",
    "model.num_layers=1",
    "model.hidden_size=16",
    "model.num_attention_heads=2",
    "model.seq_length=16",
    "model.make_vocab_size_divisible_by=16",
    "tokenizer.vocab_size=64",
    "logger.log_interval=1",
]
PRECISION = {
    "fp32": [],
    "bf16": ["model.bf16=true", "optimizer.bf16=true", "model.params_dtype=bfloat16"],
}
# Relative bounds. Losses: the engines' summation orders differ in the last bits (measured:
# fp32 < 1e-6, bf16 3e-6); with the optimizer restarted instead of converted, iteration 5 is
# 3e-3 off in both precisions. Grad norms: fp32 as the losses; in bf16 the norm is taken
# over bf16 gradients, and the last-bit difference of the fp32 main parameters after the
# first update flips the bf16 rounding of a few weights, so a few gradient elements move by
# one bf16 step (3.9e-3 relative): measured 8e-4 at iteration 6, against 6e-2 restarted.
TOL = {"lm loss": {"fp32": 1e-5, "bf16": 1e-5}, "grad-norm": {"fp32": 1e-5, "bf16": 1e-2}}


def _resume(root: Path, precision: str, *extra: str) -> int:
    overrides = [*OVERRIDES, *PRECISION[precision], f"checkpoint.load={root}", *extra]
    cfg = load_config(recipe_path("tiny_gpt"), overrides)
    return pretrain(cfg, metrics_file=str(root.parent / f"{root.name}.jsonl"))


DISTRIBUTED = ["optimizer.use_distributed_optimizer=true", "ddp.use_distributed_optimizer=true"]
# run name -> (precision, extra overrides)
CASES = {
    "fp32": ("fp32", []),
    "bf16": ("bf16", []),
    "fp32_distributed": ("fp32", DISTRIBUTED),
    "bf16_distributed": ("bf16", DISTRIBUTED),
}


def _cases(rank: int, world: int, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (precision, extra) in CASES.items():
        copy = Path(tmp) / name
        shutil.copytree(DATA / precision, copy)  # the committed data is never written
        out[name] = _resume(copy, precision, *extra)

    damaged = Path(tmp) / "damaged"
    shutil.copytree(DATA / "fp32", damaged)
    shard = damaged / "iter_0000003" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit, same size
    shard.write_bytes(bytes(data))
    try:
        out["damaged"] = _resume(damaged, "fp32")
    except CheckpointError as exc:
        out["damaged"] = str(exc)
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("portable")
    (out,) = run_distributed(_cases, 1, str(tmp), timeout=600)
    return tmp, out


@pytest.mark.multiprocess
@pytest.mark.timeout(700)
@pytest.mark.parametrize("name", list(CASES))
def test_portable_checkpoint_resumes_with_its_optimizer_state(
    resumed: tuple[Path, dict[str, Any]], name: str
) -> None:
    """Into megatron's FP32 / mixed-precision optimizer and into its distributed optimizer."""
    tmp, out = resumed
    precision = CASES[name][0]
    assert out[name] == 0
    portable = json.loads((DATA / "portable_run_metrics.json").read_text())[precision]
    records = {
        int(r["step"]): r for r in read_metrics_file(tmp / f"{name}.jsonl") if "lm loss" in r
    }
    assert sorted(records) == [4, 5, 6]
    for step in (4, 5, 6):
        want, got = portable[str(step)], records[step]
        assert got["learning-rate"] == pytest.approx(want["learning-rate"], rel=1e-12), step
        for key, bounds in TOL.items():
            bound = bounds[precision] * abs(want[key])
            assert abs(got[key] - want[key]) <= bound, (precision, step, key, got[key], want[key])


@pytest.mark.multiprocess
@pytest.mark.timeout(700)
def test_damaged_portable_checkpoint_is_refused(resumed: tuple[Path, dict[str, Any]]) -> None:
    _, out = resumed
    message = out["damaged"]
    assert isinstance(message, str), message
    assert "is damaged and is not loaded" in message and "nothing was deleted" in message
    assert "__0_0.distcp" in message
