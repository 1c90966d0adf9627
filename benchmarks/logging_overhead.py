"""Per-step cost of logging every step to all four backends, against a bare training step.

The model is a small transformer encoder (2 layers, d_model 128, 4 heads, sequence 64,
batch 8) trained with AdamW on one CPU thread: a step of a few to tens of milliseconds,
realistic for CPU training. Each logged step calls ``bridge.logging.training_log`` with
``log_interval = tensorboard_log_interval = 1`` and TensorBoard, Weights & Biases
(offline), MLflow (local file store) and Comet (offline) all on, so every step writes
every metric to every backend and formats the console line (captured, not printed).

Bare and logged steps run in alternating blocks in the same process, and the median
step time of each variant is compared, so machine noise hits both alike. The time spent
inside ``training_log`` itself is reported as well. The target is an overhead under 5%;
this script prints the ratio and never asserts it.

Run it with the extras installed, e.g. from the repository root::

    UV_PROJECT_ENVIRONMENT=.venv-logging uv sync --package bridge-logging \\
        --extra tensorboard --extra wandb --extra mlflow --extra comet --group dev
    .venv-logging/bin/python benchmarks/logging_overhead.py [--steps 40] [--rounds 5]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any


def _require_extras() -> None:
    missing = [
        m
        for m in ("tensorboard", "wandb", "mlflow", "comet_ml")
        if importlib.util.find_spec(m) is None
    ]
    if missing:
        sys.exit(
            f"missing {', '.join(missing)}: install bridge-logging with the extras "
            "tensorboard, wandb, mlflow and comet (see this script's docstring)"
        )


class Encoder:
    """The benchmark model, its data and optimizer."""

    def __init__(self) -> None:
        import torch

        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(
            d_model=128, nhead=4, dim_feedforward=512, batch_first=True, dropout=0.0
        )
        self.model = torch.nn.Sequential(
            torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False),
            torch.nn.Linear(128, 1),
        )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(8, 64, 128, generator=generator)
        self.y = torch.randn(8, 64, 1, generator=generator)

    def step(self) -> tuple[Any, float]:
        import torch

        self.optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0))
        self.optimizer.step()
        return loss.detach(), grad_norm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=15, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=7, help="timed blocks per variant")
    args = parser.parse_args()
    _require_extras()
    root = Path(tempfile.mkdtemp(prefix="logging-overhead-"))
    os.environ.update(
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        WANDB_DIR=str(root / "wandb"),
        MLFLOW_ALLOW_FILE_STORE="true",
        COMET_MODE="offline",
    )
    os.environ.pop("COMET_API_KEY", None)

    import torch

    from bridge.config import LoggerConfig, TrainingConfig
    from bridge.config.testing import tiny_container
    from bridge.logging import (
        BackendSettings,
        MetricWriters,
        build_metric_writers,
        build_timers,
        training_log,
    )

    torch.set_num_threads(1)

    def config(interval: int) -> Any:
        cfg = tiny_container(
            train=TrainingConfig(
                micro_batch_size=8, global_batch_size=8, train_iters=100_000, eval_interval=None
            ),
            logger=LoggerConfig(
                log_interval=interval,
                tensorboard_log_interval=interval,
                tensorboard_dir=str(root / "tb"),
                wandb_project="logging-overhead",
                wandb_save_dir=str(root / "wandb"),
                log_throughput=True,
                log_params_norm=True,
                log_timers_to_tensorboard=True,
                log_world_size_to_tensorboard=True,
                log_memory_to_tensorboard=True,
            ),
        )
        cfg.validate(world_size=1)
        return cfg

    every_step, every_tenth = config(1), config(10)
    everything = build_metric_writers(
        every_step.logger,
        asynchronous=False,
        rank=0,
        world_size=1,
        run_config=every_step.to_dict(),
        backend_settings=BackendSettings(
            mlflow_experiment="logging-overhead",
            mlflow_tracking_uri=f"file:{root / 'mlruns'}",
            comet_project="logging-overhead",
            comet_experiment_name="logging-overhead",
            comet_offline_dir=str(root / "comet"),
        ),
    )
    timers = build_timers(every_step.logger)
    timers("interval-time", log_level=0).start()
    state = SimpleNamespace(
        cfg=every_step,
        train_state=SimpleNamespace(
            step=0,
            consumed_train_samples=0,
            skipped_train_samples=0,
            consumed_valid_samples=0,
            floating_point_operations_so_far=0.0,
        ),
        timers=timers,
        metric_writers=everything,
        start_time=time.time(),
    )
    by_kind = {writer.kind: writer for writer in everything.writers}
    # (label, config, writers); one MetricWriters per variant over the same backends,
    # so every variant logs into the same runs with ever-increasing steps.
    backends = list(by_kind.values())
    variants: list[tuple[str, Any, Any]] = [
        (f"{kind} only, every step", every_step, MetricWriters([writer]))
        for kind, writer in by_kind.items()
    ]
    variants += [
        ("all four, every step", every_step, MetricWriters(backends)),
        ("all four, every step, thread", every_step, MetricWriters(backends, asynchronous=True)),
        ("all four, every 10th step", every_tenth, MetricWriters(backends)),
    ]
    bench = Encoder()
    total: dict[str, Any] = {}
    history: list[float] = [0.0]
    in_log: dict[str, list[float]] = {label: [] for label, _, _ in variants}
    sink = io.StringIO()

    def logged_step(label: str, cfg: Any, writers: Any) -> None:
        loss, grad_norm = bench.step()
        ts = state.train_state
        ts.step += 1
        ts.consumed_train_samples += 8
        ts.floating_point_operations_so_far += 1e9
        history.append(time.time() - state.start_time)
        state.metric_writers = writers
        started = time.perf_counter()
        training_log(
            {"lm loss": loss},
            total,
            1e-4,
            None,
            1.0,
            False,
            0,
            grad_norm,
            10.0,
            0,
            cfg,
            state,
            history,
            [bench.model],
        )
        in_log[label].append(time.perf_counter() - started)
        sink.seek(0)
        sink.truncate()

    def block(step: Any, writers: Any = None) -> tuple[float, float]:
        """Wall-clock and CPU seconds (all threads of this process) per step.

        The CPU time includes the flush that drains the asynchronous backends' backlog
        (their real work); the wall time does not, since a flush mostly waits (MLflow's
        queue polls) and the backlog would otherwise spill into the next block.
        """
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            step()
        wall = time.perf_counter() - wall
        if writers is not None:
            writers.flush()
        return wall / args.steps, (time.process_time() - cpu) / args.steps

    bare: list[tuple[float, float]] = []
    logged: dict[str, list[tuple[float, float]]] = {label: [] for label, _, _ in variants}
    with contextlib.redirect_stdout(sink):
        for label, cfg, writers in variants:  # warm-up: allocator, first writes
            for _ in range(3):
                logged_step(label, cfg, writers)
        for label in in_log:
            in_log[label].clear()
        for _ in range(args.rounds):
            bare.append(block(bench.step))
            for label, cfg, writers in variants:
                run = functools.partial(logged_step, label, cfg, writers)
                logged[label].append(block(run, writers))
    started = time.perf_counter()
    everything.close()
    close_s = time.perf_counter() - started

    def median_ms(samples: list[tuple[float, float]], which: int) -> float:
        return statistics.median(sample[which] for sample in samples) * 1e3

    bare_wall, bare_cpu = median_ms(bare, 0), median_ms(bare, 1)
    print("logging overhead of bridge.logging.training_log, local / offline backends")
    print(
        "model: 2-layer transformer encoder (d_model 128, 4 heads, seq 64, batch 8), AdamW, "
        f"1 CPU thread: a bare step takes {bare_wall:.1f} ms wall, {bare_cpu:.1f} ms CPU"
    )
    print(
        f"medians of {args.rounds} blocks of {args.steps} steps per variant, blocks alternating "
        "with bare ones; CPU = all threads of this process (robust to other load on the "
        "machine; W&B's separate service process is not included)"
    )
    header = f"{'variant':30s} {'wall ms':>8s} {'wall +%':>8s} {'CPU ms':>8s} {'CPU +%':>8s} {'in training_log':>16s}"
    print(header)
    for label, _, _ in variants:
        wall, cpu = median_ms(logged[label], 0), median_ms(logged[label], 1)
        inside = statistics.median(in_log[label]) * 1e3
        print(
            f"{label:30s} {wall:8.1f} {100 * (wall - bare_wall) / bare_wall:7.1f}% "
            f"{cpu:8.1f} {100 * (cpu - bare_cpu) / bare_cpu:7.1f}% {inside:13.2f} ms"
        )
    print(
        "target: under 5% (printed, never asserted). CPU includes the backends' background "
        "threads and the flush that drains them after each block; wall excludes that flush."
    )
    print(f"closing all backends: {close_s:.2f} s once at the end; output left in {root}")


if __name__ == "__main__":
    main()
