"""Step time of the trainer on megatron-core's engine against loops without the trainer (CPU).

The same megatron-core GPT (the model of ``benchmarks/framework_overhead.py``), optimizer
settings, learning-rate schedule, mock data, seed and number of steps, trained by:

* ``bare``: the framework-free loop of ``framework_overhead.py`` (``torch.optim.AdamW``
  over megatron's parameter groups, a ``DataLoader``, gradient accumulation; one rank only,
  it has no data parallelism);
* ``megatron-loop``: the bare megatron-core loop: megatron-core's
  ``DistributedDataParallel``, ``get_megatron_optimizer`` and ``get_forward_backward_func``
  (under core-utils' CUDA emulation on CPU) driven directly, as Megatron-LM's own
  ``train_step`` drives them (``bridge.train.loop.bare_loop.train_steps``: zero the buffers,
  the schedule, the optimizer step, the scheduler step, the loss reduction; nothing else);
* ``trainer``: ``bridge.train.pretrain`` on the same engine: everything ``bridge-train``
  runs per iteration around it (metrics, logging, exit and checkpoint decisions,
  callbacks, the rerun state machine, ...).

``trainer / megatron-loop`` is the trainer's own cost around megatron-core's engine;
``megatron-loop / bare`` the cost of megatron-core's training machinery and the CUDA
emulation against plain torch (one rank). With two ranks the loop and the trainer run data
parallel (DP=2, same global batch) on two forked gloo ranks, and the trainer also with the
distributed optimizer (``trainer+dist-opt``). Timing as in ``framework_overhead.py``: a
timestamp when an iteration's first micro-batch is fetched, the mean interval after a
warm-up, runs alternating (A B C, C B A, ...) within one process (group), medians compared;
CPU time per step is reported too, and the largest loss difference between the sides.

    uv run python benchmarks/engine_overhead.py [--steps 40] [--rounds 3] [--ranks 1 2]

The script prints the ratios and never asserts them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# A sibling script (benchmarks/ is on sys.path when this file runs), not an installed module.
from framework_overhead import (  # type: ignore[import-not-found]
    GLOBAL_BATCH,
    LOSS_AGREEMENT,
    MICRO_BATCH,
    MODEL,
    _StepClock,
    run_bare,
)

from bridge.config import LoggerConfig
from bridge.train import forward_step, pretrain
from bridge.train.metrics import read_metrics_file
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
from core_utils.testing import find_free_port, run_distributed

# trainer side name -> optimizer.use_distributed_optimizer
TRAINER_SIDES = {"trainer": False, "trainer+dist-opt": True}


def run_trainer(
    side: str, steps: int, warmup: int, workdir: Path, threads: int
) -> tuple[float, float, list[float]]:
    """``pretrain`` on the current process group: (wall, CPU, losses)."""
    torch.set_num_threads(threads)
    distributed_optimizer = TRAINER_SIDES[side]
    train = tiny_train_config(
        train_iters=steps, micro_batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH
    )
    optimizer = tiny_optimizer_config()
    optimizer.use_distributed_optimizer = distributed_optimizer
    cfg = tiny_config_container(
        train=train,
        model=tiny_gpt_provider(**MODEL),
        optimizer=optimizer,
        dataset=tiny_mock_dataset_config(sequence_length=MODEL["seq_length"]),
        logger=LoggerConfig(log_interval=10),
    )
    if distributed_optimizer and cfg.ddp is not None:
        cfg.ddp.use_distributed_optimizer = True
    metrics = workdir / f"metrics-{side}-{time.monotonic_ns()}.jsonl"
    clock = _StepClock(GLOBAL_BATCH // (MICRO_BATCH * dist.get_world_size()))
    with contextlib.redirect_stdout(io.StringIO()):
        code = pretrain(cfg, clock.wrap(forward_step), metrics_file=metrics)
    assert code == 0, f"{side}: pretrain exited with {code}"
    # The last rank writes the metrics file (it holds the loss under pipelining).
    last = dist.get_rank() == dist.get_world_size() - 1
    losses = [r["lm loss"] for r in read_metrics_file(metrics) if "lm loss" in r] if last else []
    wall, cpu = clock.per_step(warmup)
    return wall, cpu, losses


def run_megatron_loop(steps: int, warmup: int, threads: int) -> tuple[float, float, list[float]]:
    """megatron-core's DDP, optimizer and schedule driven by the bare loop: (wall, CPU, losses)."""
    from bridge.train.engine import build_engine
    from bridge.train.engine.initialize import destroy_distributed
    from bridge.train.loop.bare_loop import train_steps
    from bridge.train.models.layout_init import layout_independent_seed

    torch.set_num_threads(threads)
    train = tiny_train_config(
        train_iters=steps, micro_batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH
    )
    provider = tiny_gpt_provider(**MODEL)
    engine = build_engine()
    engine.initialize_distributed(provider, tiny_dist_config(), tiny_rng_config())
    try:
        # The trainer's default initial weights (rng.layout_independent_init), as the bare
        # loop draws them too: all three sides train the same model.
        seed = layout_independent_seed(tiny_rng_config(), provider)
        model = engine.setup_model(provider, layout_independent_seed=seed)
        optimizer, scheduler = engine.setup_optimizer(
            model, tiny_optimizer_config(), tiny_scheduler_config(), train
        )
        iterator = tiny_mock_iterator(
            train, tiny_mock_dataset_config(sequence_length=MODEL["seq_length"])
        )
        clock = _StepClock(GLOBAL_BATCH // (MICRO_BATCH * dist.get_world_size()))
        result = train_steps(
            engine,
            model,
            optimizer,
            scheduler,
            iterator,
            train_iters=steps,
            global_batch_size=GLOBAL_BATCH,
            micro_batch_size=MICRO_BATCH,
            seq_length=provider.seq_length,
            forward_step_func=clock.wrap(forward_step),
        )
    finally:
        destroy_distributed()  # the emulation and parallel state; the group stays
    wall, cpu = clock.per_step(warmup)
    return wall, cpu, result.losses


def run_side(
    side: str, steps: int, warmup: int, workdir: Path, threads: int
) -> tuple[float, float, list[float]]:
    """One run of ``side`` on the current process group."""
    if side == "bare":
        with contextlib.redirect_stdout(io.StringIO()):
            return run_bare(steps, warmup)
    if side == "megatron-loop":
        return run_megatron_loop(steps, warmup, threads)
    return run_trainer(side, steps, warmup, workdir, threads)


def _order(sides: list[str], rounds: int) -> list[str]:
    """A B C, C B A, ...: each side sees the machine in every position alike."""
    order: list[str] = []
    for r in range(rounds):
        order += sides if r % 2 == 0 else list(reversed(sides))
    return order


def _rank_main(
    rank: int, world: int, sides: list[str], rounds: int, steps: int, warmup: int, threads: int
) -> dict[str, Any]:
    results: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
    losses: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for side in _order(sides, rounds):
            wall, cpu, side_losses = run_side(side, steps, warmup, Path(tmp), threads)
            results[side].append((wall, cpu))
            losses[side] = side_losses
    return {"results": results, "losses": losses}


def _report(title: str, results: dict[str, list[tuple[float, float]]], losses: Any) -> None:
    med = {
        side: (
            statistics.median(r[0] for r in runs),
            statistics.median(r[1] for r in runs),
        )
        for side, runs in results.items()
    }
    print(f"\n{title}")
    for side, (wall, cpu) in med.items():
        print(f"  {side:18s} {wall * 1e3:8.2f} ms/step wall  {cpu * 1e3:8.2f} ms/step CPU")
    ratios = [("trainer", "megatron-loop"), ("trainer+dist-opt", "megatron-loop")]
    ratios += [("megatron-loop", "bare"), ("trainer", "bare")]
    for side, base in ratios:
        if side in med and base in med:
            print(
                f"  ratio {side} / {base}: wall {med[side][0] / med[base][0]:.3f}, "
                f"CPU {med[side][1] / med[base][1]:.3f}"
            )
    reference = losses["megatron-loop"]
    for side, side_losses in losses.items():
        if side != "megatron-loop" and side_losses:
            diff = max(abs(a - b) for a, b in zip(reference, side_losses, strict=True))
            print(f"  max |loss difference| {side} vs megatron-loop: {diff:.3g}")
            if diff > LOSS_AGREEMENT:  # then the ratios above compare different trainings
                raise SystemExit(
                    f"engine_overhead: {side} and megatron-loop trained differently (loss "
                    f"difference {diff:.3g} > {LOSS_AGREEMENT}); the ratios compare nothing"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="iterations per run")
    parser.add_argument("--warmup", type=int, default=5, help="iterations not timed per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs per side (ABC/CBA order)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    args = parser.parse_args()
    print(
        f"model {MODEL}, micro batch {MICRO_BATCH}, global batch {GLOBAL_BATCH}, "
        f"{args.steps} steps per run ({args.warmup} warm-up), {args.rounds} rounds, "
        f"{args.threads} thread(s) per rank"
    )
    if 2 in args.ranks:
        # Forked before this process runs anything heavy (a fork of a process whose OpenMP
        # pool ran can deadlock).
        per_rank = run_distributed(
            _rank_main,
            2,
            ["megatron-loop", "trainer", "trainer+dist-opt"],
            args.rounds,
            args.steps,
            args.warmup,
            args.threads,
            timeout=3600,
        )
        _report("2 ranks (DP=2), rank 1:", per_rank[1]["results"], per_rank[1]["losses"])
    if 1 in args.ranks:
        torch.set_num_threads(args.threads)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{find_free_port()}",
            rank=0,
            world_size=1,
            timeout=timedelta(minutes=10),
        )
        sides = ["bare", "megatron-loop", "trainer"]
        results: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
        losses: dict[str, list[float]] = {}
        with tempfile.TemporaryDirectory() as tmp:
            for side in _order(sides, args.rounds):
                wall, cpu, side_losses = run_side(
                    side, args.steps, args.warmup, Path(tmp), args.threads
                )
                results[side].append((wall, cpu))
                losses[side] = side_losses
                print(f"  1 rank {side:14s} {wall * 1e3:8.2f} ms/step", flush=True)
        dist.destroy_process_group()
        _report("1 rank:", results, losses)


if __name__ == "__main__":
    main()
