"""Step time of the full trainer (``bridge.train.pretrain``) against the bare loop.

Both sides train the same megatron-core GPT (portable engine, one rank, gloo) with the same
optimizer, scheduler, mock data and seed, so they compute the same losses (checked and
printed). The bare loop is ``bridge.train.train_steps`` (zero grads, forward-backward,
optimizer and scheduler step, loss reduction: nothing else). The trainer adds everything
``bridge-train`` runs per iteration: ``train_step`` with the rerun state machine, the
TrainState and FLOP counters, ``training_log`` with the console line every 10 iterations,
the post-step callbacks (fault-tolerance hooks, straggler timing), exit conditions and
checkpoint decisions.

Each iteration is timed the same way on both sides: a wrapper around the forward step
records a timestamp when an iteration's first micro-batch starts, and the step time is
the mean interval between consecutive iterations after a warm-up (setup and teardown are
not counted). Bare and trainer runs alternate (A B B A ...) in one process so machine noise
hits both alike; the median of the runs of each side is compared. Also reported: the CPU
time of the process per step, which other load on the machine disturbs less.

    uv run python benchmarks/framework_overhead.py [--steps 40] [--rounds 3]

The target ratio is <= 1.03; the script prints it and never asserts it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bridge.config import LoggerConfig
from bridge.train import forward_step, pretrain, read_metrics_file, train_steps
from bridge.train.engines import PortableEngine
from bridge.train.testing import (
    tiny_config_container,
    tiny_dist_config,
    tiny_gpt_provider,
    tiny_mock_dataset_config,
    tiny_mock_iterator,
    tiny_optimizer_config,
    tiny_rng_config,
    tiny_scheduler_config,
    tiny_train_config,
)
from core_utils.testing import find_free_port

MODEL = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "seq_length": 256}
MICRO_BATCH, GLOBAL_BATCH = 4, 8


class _StepClock:
    """Wraps a forward step; records wall and CPU time when an iteration starts."""

    def __init__(self, num_microbatches: int) -> None:
        self.num_microbatches = num_microbatches
        self.calls = 0
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def wrap(self, step: Callable[..., Any]) -> Callable[..., Any]:
        def timed(state: Any, data_iterator: Any, model: Any) -> Any:
            if self.calls % self.num_microbatches == 0 and model.training:
                self.wall.append(time.perf_counter())
                self.cpu.append(time.process_time())
            self.calls += 1
            return step(state, data_iterator, model)

        return timed

    def per_step(self, warmup: int) -> tuple[float, float]:
        """Mean wall and CPU seconds per iteration after ``warmup`` iterations."""
        wall, cpu = self.wall[warmup:], self.cpu[warmup:]
        n = len(wall) - 1
        return (wall[-1] - wall[0]) / n, (cpu[-1] - cpu[0]) / n


def _train_config(steps: int) -> Any:
    return tiny_train_config(
        train_iters=steps, micro_batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH
    )


def _dataset_config() -> Any:
    return tiny_mock_dataset_config(sequence_length=MODEL["seq_length"])


def run_bare(steps: int, warmup: int) -> tuple[float, float, list[float]]:
    """The bare loop: returns (wall s/step, CPU s/step, losses)."""
    provider = tiny_gpt_provider(**MODEL)
    engine = PortableEngine()
    engine.initialize_distributed(provider, tiny_dist_config(), tiny_rng_config())
    model = engine.setup_model(provider)
    train = _train_config(steps)
    optimizer, scheduler = engine.setup_optimizer(
        model, tiny_optimizer_config(), tiny_scheduler_config(), train
    )
    iterator = tiny_mock_iterator(train, _dataset_config())
    clock = _StepClock(GLOBAL_BATCH // MICRO_BATCH)
    result = train_steps(
        engine,
        model,
        optimizer,
        scheduler,
        iterator,
        train_iters=steps,
        global_batch_size=GLOBAL_BATCH,
        micro_batch_size=MICRO_BATCH,
        seq_length=MODEL["seq_length"],
        forward_step_func=clock.wrap(forward_step),
    )
    wall, cpu = clock.per_step(warmup)
    return wall, cpu, result.losses


def run_trainer(steps: int, warmup: int, workdir: Path) -> tuple[float, float, list[float]]:
    """``pretrain`` with the console line every 10 iterations: (wall, CPU, losses)."""
    cfg = tiny_config_container(
        train=_train_config(steps),
        model=tiny_gpt_provider(**MODEL),
        dataset=_dataset_config(),
        logger=LoggerConfig(log_interval=10),
    )
    metrics = workdir / f"metrics-{time.monotonic_ns()}.jsonl"
    clock = _StepClock(GLOBAL_BATCH // MICRO_BATCH)
    console = io.StringIO()
    with contextlib.redirect_stdout(console):  # the log lines are produced, not shown
        code = pretrain(cfg, clock.wrap(forward_step), metrics_file=metrics)
    assert code == 0
    losses = [r["lm loss"] for r in read_metrics_file(metrics) if "lm loss" in r]
    lines = [line for line in console.getvalue().splitlines() if "] iteration " in line]
    assert len(lines) == steps // 10, console.getvalue()[-2000:]
    wall, cpu = clock.per_step(warmup)
    return wall, cpu, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="iterations per run")
    parser.add_argument("--warmup", type=int, default=5, help="iterations not timed per run")
    parser.add_argument("--rounds", type=int, default=3, help="bare/trainer pairs (ABBA order)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # One process group for every run (the trainer reuses it and leaves it alone).
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{find_free_port()}",
        rank=0,
        world_size=1,
        timeout=timedelta(minutes=5),
    )
    results: dict[str, list[tuple[float, float]]] = {"bare": [], "trainer": []}
    losses: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        order = []
        for r in range(args.rounds):
            order += ["bare", "trainer"] if r % 2 == 0 else ["trainer", "bare"]
        for side in order:
            if side == "bare":
                wall, cpu, side_losses = run_bare(args.steps, args.warmup)
            else:
                wall, cpu, side_losses = run_trainer(args.steps, args.warmup, Path(tmp))
            results[side].append((wall, cpu))
            losses[side] = side_losses
            print(
                f"{side:8s} {wall * 1e3:8.2f} ms/step wall  {cpu * 1e3:8.2f} ms/step CPU",
                flush=True,
            )
    dist.destroy_process_group()

    diff = max(abs(a - b) for a, b in zip(losses["bare"], losses["trainer"], strict=True))
    med = {
        side: [statistics.median(v[i] for v in runs) for i in (0, 1)]
        for side, runs in results.items()
    }
    print(
        f"\nmodel {MODEL}, micro batch {MICRO_BATCH}, global batch {GLOBAL_BATCH}, "
        f"{args.steps} steps per run ({args.warmup} warm-up), {args.rounds} rounds, "
        f"{args.threads} thread(s)"
    )
    # The trainer's losses are read back from its metrics file; bridge.logging passes losses
    # through float32, so agreement is to float32 rounding (about 5e-7 at loss 5).
    print(f"same losses on both sides: max |difference| = {diff:.3g} (float32 rounding)")
    print(
        f"median wall per step: bare {med['bare'][0] * 1e3:.2f} ms, "
        f"trainer {med['trainer'][0] * 1e3:.2f} ms"
    )
    print(
        f"median CPU per step:  bare {med['bare'][1] * 1e3:.2f} ms, "
        f"trainer {med['trainer'][1] * 1e3:.2f} ms"
    )
    print(
        f"ratio trainer / bare: wall {med['trainer'][0] / med['bare'][0]:.3f}, "
        f"CPU {med['trainer'][1] / med['bare'][1]:.3f} (target <= 1.03)"
    )


if __name__ == "__main__":
    sys.exit(main())
