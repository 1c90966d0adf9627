"""Step time of the full trainer (``bridge.train.pretrain``) against a bare training loop.

Both sides train the same megatron-core GPT (one rank, gloo process group) with the same
optimizer settings, learning-rate schedule, mock data and seed. The bare loop is what a
user would write without any framework: the ``GPTModel`` from the provider, no wrapper,
``torch.optim.AdamW`` over megatron's parameter groups (no weight decay on biases and
norms), megatron-core's ``OptimizerParamScheduler``, a plain ``DataLoader`` over the same
mock dataset, gradient accumulation over the micro-batches, ``clip_grad_norm_`` and a
``print`` of the loss every 10 iterations. The trainer adds everything ``bridge-train``
runs per iteration: megatron-core's engine (its ``DistributedDataParallel`` with gradient
buckets, ``get_megatron_optimizer``, the micro-batch schedule, on CPU under core-utils' CUDA
emulation; ``benchmarks/engine_overhead.py`` separates the engine from the trainer),
``train_step`` with the rerun state machine, the TrainState and FLOP counters, ``training_log`` with the console
line every 10 iterations, the post-step callbacks (fault-tolerance hooks, straggler
timing), exit conditions and checkpoint decisions.

Each iteration is timed the same way on both sides: a timestamp when an iteration's first
micro-batch is fetched; the step time is the mean interval between consecutive iterations
after a warm-up (setup and teardown are not counted). Bare and trainer runs alternate
(A B B A ...) in one process so machine noise hits both alike; the median of the runs of
each side is compared. Also reported: the CPU time of the process per step, which other
load on the machine disturbs less, and the largest difference between the two sides'
losses (they agree to float rounding: the trainer accumulates gradients in a buffer).

    uv run python benchmarks/framework_overhead.py [--steps 40] [--rounds 3]

A third side is the trainer with a no-op user callback registered (``on_step_start`` and
``on_step_end`` overridden, so it is called twice per step): the cost of the callback hooks.
The target ratio is <= 1.03 for both trainer sides; the script prints them and never
asserts them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bridge.config import LoggerConfig
from bridge.train import Callback, forward_step, pretrain
from bridge.train.metrics import read_metrics_file
from bridge.train.testing import (
    TINY_VOCAB,
    tiny_config_container,
    tiny_gpt_provider,
    tiny_mock_dataset_config,
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


#: Largest loss difference that is float rounding (measured: 3.6e-7 over 20 steps).
LOSS_AGREEMENT = 1e-4


def _dataset_config() -> Any:
    return tiny_mock_dataset_config(sequence_length=MODEL["seq_length"])


def _bare_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """megatron's default grouping: no weight decay on biases and 1-D parameters (norms)."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if name.endswith(".bias") or param.ndim == 1 else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0},
        {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0},
    ]


def run_bare(steps: int, warmup: int) -> tuple[float, float, list[float]]:
    """The bare loop (no framework): returns (wall s/step, CPU s/step, losses)."""
    from megatron.core import parallel_state
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from bridge.train.data import NullTokenizer, build_train_valid_test_datasets
    from bridge.train.models.layout_init import (
        initialize_layout_independent,
        layout_independent_seed,
    )

    parallel_state.initialize_model_parallel()
    torch.manual_seed(tiny_rng_config().seed)
    provider = tiny_gpt_provider(**MODEL)
    model = provider.provide()
    # The trainer draws its initial weights layout-independently (rng.layout_independent_init,
    # on by default): the same draw here, so both sides train the same model.
    seed = layout_independent_seed(tiny_rng_config(), provider)
    if seed is not None:
        initialize_layout_independent([model], provider, seed)
    opt_cfg = tiny_optimizer_config()
    optimizer = torch.optim.AdamW(
        _bare_param_groups(model, opt_cfg.weight_decay),
        lr=opt_cfg.lr,
        betas=(opt_cfg.adam_beta1, opt_cfg.adam_beta2),
        eps=opt_cfg.adam_eps,
    )
    sched_cfg = tiny_scheduler_config()
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=opt_cfg.lr,
        min_lr=opt_cfg.min_lr,
        lr_warmup_steps=sched_cfg.lr_warmup_iters * GLOBAL_BATCH,
        lr_decay_steps=steps * GLOBAL_BATCH,
        lr_decay_style=sched_cfg.lr_decay_style,
        start_wd=opt_cfg.weight_decay,
        end_wd=opt_cfg.weight_decay,
        wd_incr_steps=steps * GLOBAL_BATCH,
        wd_incr_style="constant",
    )
    train_ds, _, _ = build_train_valid_test_datasets(
        _dataset_config(), NullTokenizer(TINY_VOCAB), (steps * GLOBAL_BATCH, 0, 0)
    )
    loader = torch.utils.data.DataLoader(train_ds, batch_size=MICRO_BATCH, drop_last=True)
    batches = iter(loader)
    accumulation = GLOBAL_BATCH // MICRO_BATCH
    wall: list[float] = []
    cpu: list[float] = []
    losses: list[float] = []
    model.train()
    for iteration in range(1, steps + 1):
        wall.append(time.perf_counter())
        cpu.append(time.process_time())
        optimizer.zero_grad(set_to_none=True)
        loss_sum, tokens = 0.0, 0.0
        for _ in range(accumulation):
            batch = next(batches)
            per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
            mask = batch["loss_mask"].float()
            masked = (per_token.float() * mask).sum()
            count = mask.sum()
            (masked / count / accumulation).backward()
            loss_sum += float(masked.detach())
            tokens += float(count)
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg.clip_grad)
        optimizer.step()
        scheduler.step(increment=GLOBAL_BATCH)
        losses.append(loss_sum / tokens)
        if iteration % 10 == 0:
            print(f"iteration {iteration}/{steps} | lm loss {losses[-1]:.6E}")
    parallel_state.destroy_model_parallel()
    n = len(wall) - 1 - warmup
    return (
        (wall[-1] - wall[warmup]) / n,
        (cpu[-1] - cpu[warmup]) / n,
        losses,
    )


class NoOpCallback(Callback):
    """A user callback that is called at every step and does nothing: the cost of the hook."""

    def on_step_start(self, context: Any) -> None:
        pass

    def on_step_end(self, context: Any) -> None:
        pass


def run_trainer(
    steps: int, warmup: int, workdir: Path, callbacks: list[Callback] | None = None
) -> tuple[float, float, list[float]]:
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
        code = pretrain(
            cfg, clock.wrap(forward_step), metrics_file=metrics, callbacks=callbacks or []
        )
    assert code == 0
    losses = [r["lm loss"] for r in read_metrics_file(metrics) if "lm loss" in r]
    lines = [line for line in console.getvalue().splitlines() if "] iteration " in line]
    assert len(lines) == steps // 10, console.getvalue()[-2000:]
    wall, cpu = clock.per_step(warmup)
    return wall, cpu, losses


def one_process_group() -> None:
    """One gloo process group of one rank for every run (the trainer reuses it and leaves it
    alone)."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{find_free_port()}",
        rank=0,
        world_size=1,
        timeout=timedelta(minutes=5),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="iterations per run")
    parser.add_argument("--warmup", type=int, default=5, help="iterations not timed per run")
    parser.add_argument("--rounds", type=int, default=3, help="bare/trainer pairs (ABBA order)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    one_process_group()
    sides = ("bare", "trainer", "trainer+cb")
    results: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
    losses: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        order = []
        for r in range(args.rounds):
            order += list(sides) if r % 2 == 0 else list(reversed(sides))
        for side in order:
            if side == "bare":
                wall, cpu, side_losses = run_bare(args.steps, args.warmup)
            elif side == "trainer":
                wall, cpu, side_losses = run_trainer(args.steps, args.warmup, Path(tmp))
            else:
                wall, cpu, side_losses = run_trainer(
                    args.steps, args.warmup, Path(tmp), callbacks=[NoOpCallback()]
                )
            results[side].append((wall, cpu))
            losses[side] = side_losses
            print(
                f"{side:10s} {wall * 1e3:8.2f} ms/step wall  {cpu * 1e3:8.2f} ms/step CPU",
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
    # Not bit-identical: the trainer sums gradients into a buffer and its losses come back
    # from the metrics file through float32; the two runs agree to float rounding.
    print(f"same training on both sides: max |loss difference| = {diff:.3g}")
    if diff > LOSS_AGREEMENT:
        # A ratio between two different trainings measures nothing (the trainer's initial
        # weights or data went another way): say so instead of printing it as the overhead.
        raise SystemExit(
            f"framework_overhead: the two sides trained differently (loss difference {diff:.3g}"
            f" > {LOSS_AGREEMENT}); the step-time ratio below would not compare like with like"
        )
    print(
        f"median wall per step: bare {med['bare'][0] * 1e3:.2f} ms, "
        f"trainer {med['trainer'][0] * 1e3:.2f} ms, "
        f"with a no-op callback {med['trainer+cb'][0] * 1e3:.2f} ms"
    )
    print(
        f"median CPU per step:  bare {med['bare'][1] * 1e3:.2f} ms, "
        f"trainer {med['trainer'][1] * 1e3:.2f} ms, "
        f"with a no-op callback {med['trainer+cb'][1] * 1e3:.2f} ms"
    )
    for side in sides[1:]:
        print(
            f"ratio {side} / bare: wall {med[side][0] / med['bare'][0]:.3f}, "
            f"CPU {med[side][1] / med['bare'][1]:.3f} (target <= 1.03)"
        )
    assert losses["trainer"] == losses["trainer+cb"], "a no-op callback changed the losses"


if __name__ == "__main__":
    main()
