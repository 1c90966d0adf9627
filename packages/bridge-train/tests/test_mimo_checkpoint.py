"""MIMO checkpoints through the ``mimo`` recipe: exact resume under two heterogeneous
layouts, layout changes (the generators reseeded), SIGTERM save-and-exit, damaged and absent
checkpoints.

Every check runs the real recipe (``pretrain_mimo``) several times inside one process group
launch, and compares per-iteration losses from the metrics file and, where the RNG state
matters, what a callback draws from every generator before each step.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from logging.handlers import BufferingHandler
from pathlib import Path
from typing import Any

import pytest

from bridge.config import load_config
from bridge.train.checkpointing import CheckpointError, read_tracker
from bridge.train.engine.initialize import resume_seed, seed_process_generators
from bridge.train.loop.pretrain_mimo import pretrain_mimo
from bridge.train.recipes import recipe_path
from core_utils.callbacks import Callback
from core_utils.testing import run_distributed

BASE = [
    "train.train_iters=6",
    "scheduler.lr_warmup_iters=1",
    "logger.log_interval=1",
    "model.num_samples=64",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
]


def _run(tmp: Path, metrics: str, *overrides: str, callbacks: tuple[Callback, ...] = ()) -> int:
    cfg = load_config(recipe_path("mimo"), [*BASE, *overrides])
    return pretrain_mimo(cfg, metrics_file=tmp / f"{metrics}.jsonl", callbacks=callbacks)


class _Events(Callback):
    """A user callback on the MIMO loop: which steps ended and which saves were committed."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def on_step_end(self, context: Any) -> None:
        self.events.append(("step", context.iteration))

    def on_save(self, context: Any) -> None:
        self.events.append(("save", context.iteration))


class _Draws(Callback):
    """Draws from every generator a checkpoint's RNG state holds before each step, as
    dropout would (the tiny VLM has none), keyed by the iteration about to run."""

    def __init__(self) -> None:
        self.draws: dict[int, tuple[float, ...]] = {}

    def on_step_start(self, context: Any) -> None:
        self.draws[context.iteration + 1] = _draw()


def _draw() -> tuple[float, ...]:
    import random

    import numpy as np
    import torch

    return (*torch.rand(2).tolist(), random.random(), float(np.random.rand()))


def _resume_three_relaid(tmp: Path, ckpt: Path, *layout: str) -> dict[int, tuple[float, ...]]:
    """Run "relaid": checkpoint 3 of ``ckpt`` continued under another ``layout``. Every rank's
    generators draw what ones seeded from rng.seed and iteration 3 draw; returns the draws."""
    relaid = _Draws()
    steps = ("checkpoint.ckpt_step=3", *layout)
    assert _run(tmp, "relaid", f"checkpoint.load={ckpt}", *steps, callbacks=(relaid,)) == 0
    seed_process_generators(resume_seed(1234, 3))
    assert relaid.draws == {i: _draw() for i in (4, 5, 6)}
    return relaid.draws


def _losses(tmp: Path, metrics: str) -> dict[int, float]:
    lines = (tmp / f"{metrics}.jsonl").read_text().splitlines()
    return {int(r["step"]): float(r["lm loss"]) for r in map(json.loads, lines)}


def _iterations(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("iter_"))


def _sigterm_at_step(rank_to_signal: int, step_number: int) -> Any:
    """Make this rank send itself SIGTERM just before its ``step_number``-th step."""
    import torch.distributed as dist

    import bridge.mimo as mimo

    original = mimo.MimoTrainStep.__call__
    calls = [0]

    def patched(self: Any, microbatches: Any) -> Any:
        calls[0] += 1
        if dist.get_rank() == rank_to_signal and calls[0] == step_number:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, microbatches)

    mimo.MimoTrainStep.__call__ = patched  # type: ignore[method-assign]
    return original


def _two_rank_checks(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    """Encoder on rank 0, language model on rank 1 (the recipe's split layout on 2 ranks)."""
    import bridge.mimo as mimo

    ckpt = tmp / "ckpt"
    out: dict[str, Any] = {}
    straight = _Draws()
    assert _run(tmp, "straight", callbacks=(straight,)) == 0
    # SIGTERM reaches rank 1 during iteration 3: every rank saves iteration 3, then exits
    # with the code GPT uses (0: ended on purpose, resumable). Iteration 2 is the interval's.
    original = _sigterm_at_step(1, 3)
    events = _Events()
    try:
        out["signal_exit"] = _run(
            tmp,
            "signalled",
            f"checkpoint.save={ckpt}",
            "checkpoint.save_interval=2",
            "train.exit_signal_handler=true",
            "logger.log_progress=true",
            callbacks=(events, _Draws()),
        )
    finally:
        mimo.MimoTrainStep.__call__ = original  # type: ignore[method-assign]
    out["events"] = events.events
    out["after_signal"] = _iterations(ckpt)
    out["progress"] = [
        line.split("\t")[3:5] for line in (ckpt / "progress.txt").read_text().splitlines()
    ]
    # Resumes the save directory's newest checkpoint (3), and its data position.
    resumed = _Draws()
    assert _run(tmp, "resumed", f"checkpoint.save={ckpt}", callbacks=(resumed,)) == 0
    out["after_resume"] = _iterations(ckpt)
    # The same layout: every generator continues where the uninterrupted run's stood.
    assert resumed.draws == {i: straight.draws[i] for i in (4, 5, 6)}
    # Another layout (both modules on both ranks): the saved states are other ranks', so
    # every generator is reseeded from rng.seed and iteration 3, on every rank alike.
    warnings = BufferingHandler(100)
    logging.getLogger("bridge.train.checkpointing.load").addHandler(warnings)
    try:
        relaid = _resume_three_relaid(tmp, ckpt, "model.layout=colocated")
    finally:
        logging.getLogger("bridge.train.checkpointing.load").removeHandler(warnings)
    assert relaid[4] not in (straight.draws[4], straight.draws[1])
    out["relaid_warnings"] = [
        r.getMessage() for r in warnings.buffer if "another parallel layout" in r.getMessage()
    ]
    # A damaged newest checkpoint: the newest older one that verifies is loaded instead.
    if rank == 0:
        shard = sorted((ckpt / "iter_0000006").glob("*.distcp"))[0]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    import torch.distributed as dist

    dist.barrier()
    assert _run(tmp, "after_damage", f"checkpoint.save={ckpt}") == 0
    out["after_damage"] = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iter_"))
    try:
        _run(
            tmp,
            "absent",
            f"checkpoint.load={tmp / 'typo'}",
            "checkpoint.exit_on_missing_checkpoint=true",
        )
    except CheckpointError as exc:
        out["absent"] = str(exc)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_two_rank_resume_signal_and_damage(tmp_path: Path) -> None:
    results = run_distributed(_two_rank_checks, 2, tmp_path, timeout=360)
    out = results[0]
    assert {**results[1], "relaid_warnings": []} == {**out, "relaid_warnings": []}
    straight = _losses(tmp_path, "straight")
    assert sorted(straight) == [1, 2, 3, 4, 5, 6]
    # SIGTERM: exit code 0, the interval's checkpoint and exactly one for the signal.
    assert out["signal_exit"] == 0
    assert out["after_signal"] == ["iter_0000002", "iter_0000003"]
    # A user callback runs in the MIMO loop too (the save at 2 is seen before step 3 ends).
    assert out["events"] == [("step", 1), ("step", 2), ("save", 2), ("step", 3), ("save", 3)]
    # logger.log_progress: progress.txt as for GPT (the launch, then each persistent save).
    assert out["progress"] == [
        ["Starting job"],
        ["Saved checkpoint", "Iteration: 2"],
        ["Saved checkpoint", "Iteration: 3"],
    ]
    assert read_tracker(tmp_path / "ckpt") == 6
    signalled = _losses(tmp_path, "signalled")
    assert sorted(signalled) == [1, 2, 3]
    resumed = _losses(tmp_path, "resumed")
    assert sorted(resumed) == [4, 5, 6]
    # Bit-exact: same losses as the uninterrupted run (model, optimizer, scheduler, data).
    assert {**signalled, **resumed} == straight
    assert out["after_resume"] == ["iter_0000002", "iter_0000003", "iter_0000006"]
    # Damaged iteration 6: iteration 3 was loaded, 4-6 trained again with the same losses,
    # and the damaged directory was kept aside, not deleted.
    assert _losses(tmp_path, "after_damage") == resumed
    assert "iter_0000006.damaged" in out["after_damage"]
    assert "does not exist and checkpoint.exit_on_missing_checkpoint=True" in out["absent"]
    assert str(tmp_path / "typo") in out["absent"]
    # The layout change: one warning (rank 0) naming both layouts and the reseed; the model
    # and optimizer resharded (no dropout: the losses continue within fp32 rounding).
    (warning,) = results[0]["relaid_warnings"]
    assert results[1]["relaid_warnings"] == []
    assert (
        "(vision rank 0 TP1 DP1, language rank 1 TP1 DP1 -> language ranks 0-1 TP1 DP2, "
        "vision ranks 0-1 TP1 DP2)" in warning
    )
    assert "reseeded from rng.seed=1234 and iteration 3" in warning
    assert f"base seed {resume_seed(1234, 3)}" in warning
    relaid = _losses(tmp_path, "relaid")
    assert sorted(relaid) == [4, 5, 6]
    for iteration, loss in relaid.items():
        assert loss == pytest.approx(straight[iteration], rel=1e-5, abs=1e-6)


def _four_rank_checks(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    """Encoder DP 2 on ranks 0-1, language TP 2 on ranks 2-3; then language DP 2."""
    ckpt = tmp / "ckpt"
    assert _run(tmp, "straight") == 0
    # Asynchronous save of the exit checkpoint, committed when the run closes.
    assert (
        _run(
            tmp,
            "first",
            f"checkpoint.save={ckpt}",
            "train.exit_interval=3",
            "checkpoint.async_save=true",
        )
        == 0
    )
    saved = _iterations(ckpt)
    assert _run(tmp, "resumed", f"checkpoint.save={ckpt}") == 0
    # Another MIMO layout: language TP 2 -> DP 2 (megatron reshards the TP shards, and the
    # per-parameter optimizer state with them); the generators are reseeded.
    _resume_three_relaid(tmp, ckpt, "model.language_parallel=dp")
    return {"saved": saved}


@pytest.mark.multiprocess
@pytest.mark.timeout(500)
def test_four_rank_resume_and_layout_change(tmp_path: Path) -> None:
    results = run_distributed(_four_rank_checks, 4, tmp_path, timeout=460)
    assert results[0]["saved"] == ["iter_0000003"]
    straight = _losses(tmp_path, "straight")
    first, resumed = _losses(tmp_path, "first"), _losses(tmp_path, "resumed")
    assert sorted(first) == [1, 2, 3] and sorted(resumed) == [4, 5, 6]
    assert {**first, **resumed} == straight
    relaid = _losses(tmp_path, "relaid")
    assert sorted(relaid) == [4, 5, 6]
    for iteration, loss in relaid.items():
        assert loss == pytest.approx(straight[iteration], rel=1e-5, abs=1e-6)


def _save_at_three_of_six(rank: int, world: int, tmp: Path) -> None:
    assert _run(tmp, "straight") == 0
    assert _run(tmp, "first", f"checkpoint.save={tmp / 'ckpt'}", "train.exit_interval=3") == 0


def _continue_from_three(rank: int, world: int, tmp: Path) -> None:
    assert _run(tmp, "continued", f"checkpoint.load={tmp / 'ckpt'}") == 0


@pytest.mark.extended
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_four_rank_checkpoint_continues_on_two_ranks(tmp_path: Path) -> None:
    """Another world size: encoder DP 2 | language TP 2 (4 ranks) saved, encoder on rank 0 |
    language on rank 1 (2 ranks) loaded: DP 2 -> 1 and TP 2 -> 1 resharded."""
    run_distributed(_save_at_three_of_six, 4, tmp_path, timeout=420)
    run_distributed(_continue_from_three, 2, tmp_path, timeout=420)
    straight = _losses(tmp_path, "straight")
    continued = _losses(tmp_path, "continued")
    assert sorted(continued) == [4, 5, 6]
    for iteration, loss in continued.items():
        assert loss == pytest.approx(straight[iteration], rel=1e-5, abs=1e-6)
