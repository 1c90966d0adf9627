"""Per-step cost of logging every step to all four backends, against a bare training step.

The model is a small transformer encoder (2 layers, d_model 128, 4 heads, sequence 64,
batch 8) trained with AdamW on one CPU thread: a step of a few tens of milliseconds,
realistic for CPU training. Each logged step calls ``bridge.logging.training_log`` with
``log_interval = tensorboard_log_interval = 1`` and TensorBoard, Weights & Biases
(offline), MLflow (local file store) and Comet (offline) all on, so every step writes
every metric to every backend and formats the console line (captured, not printed).

Two sets of writers over the same four backends are built, both from ``LoggerConfig``:
``metrics_writer_mode="process"`` (the default: all four run in a metric writer process)
and ``"inline"`` (everything in the training process), each into its own runs. A row with
no backend at all shows what ``training_log`` itself costs (the metrics, the console line).

Each logged block of steps runs right after a bare block in the same process, and the
overhead is the median over rounds of their ratio, so load that drifts during the run
(other processes on the machine) cancels; a control row (a bare block after a bare block)
shows the noise floor. Per step it reports

* wall time of the training process, without and with the drain at the end of each
  block (a flush: in process mode it waits until the writer process has written
  everything, so a writer process that cannot keep up shows here);
* CPU time of the training process (all its threads; robust to other load on the
  machine);
* CPU time of the metric writer process (process mode; it runs on another core);
* the time spent inside ``training_log`` itself.

W&B's own service process (``wandb-core``) is not counted in either mode. The target is an
overhead under 5% for the default mode; this script prints the ratios and never asserts
them. The machine's load average at the start and the end is printed: on a machine whose
cores are busy with other work, the writer process competes for them and wall times say
more about that competition than about logging.

Run it with the extras installed, e.g. from the repository root::

    UV_PROJECT_ENVIRONMENT=.venv-logging uv sync --package bridge-logging \\
        --extra tensorboard --extra wandb --extra mlflow --extra comet --group dev
    .venv-logging/bin/python benchmarks/logging_overhead.py [--steps 15] [--rounds 7]
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

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


CONTROL = "control: a bare step again"


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


def _cpu_seconds(pids: tuple[int, ...]) -> float:
    """User + system CPU seconds used so far by the processes ``pids`` (Linux /proc)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / CLOCK_TICKS


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
    load_at_start = os.getloadavg()[0]
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
    from bridge.logging import MetricWriters, build_metric_writers, build_timers, training_log

    torch.set_num_threads(1)

    def logger_config(interval: int, mode: str) -> LoggerConfig:
        where = root / mode
        return LoggerConfig(
            log_interval=interval,
            tensorboard_log_interval=interval,
            tensorboard_dir=str(where / "tb"),
            wandb_project="logging-overhead",
            wandb_exp_name=f"logging-overhead-{mode}",
            wandb_save_dir=str(where / "wandb"),
            mlflow_experiment="logging-overhead",
            mlflow_tracking_uri=f"file:{where / 'mlruns'}",
            comet_project="logging-overhead",
            comet_offline_dir=str(where / "comet"),
            log_throughput=True,
            log_params_norm=True,
            log_timers_to_tensorboard=True,
            log_world_size_to_tensorboard=True,
            log_memory_to_tensorboard=True,
            metrics_writer_mode=mode,  # type: ignore[arg-type]
        )

    def config(logger: LoggerConfig) -> Any:
        cfg = tiny_container(
            train=TrainingConfig(
                micro_batch_size=8, global_batch_size=8, train_iters=100_000, eval_interval=None
            ),
            logger=logger,
        )
        cfg.validate(world_size=1)
        return cfg

    every_step = config(logger_config(1, "process"))
    started = time.perf_counter()
    process_writers = build_metric_writers(
        every_step.logger, rank=0, world_size=1, run_config=every_step.to_dict()
    )
    build_process_s = time.perf_counter() - started
    inline_cfg = config(logger_config(1, "inline"))
    started = time.perf_counter()
    inline_writers = build_metric_writers(
        inline_cfg.logger, rank=0, world_size=1, run_config=inline_cfg.to_dict()
    )
    build_inline_s = time.perf_counter() - started
    every_tenth = config(logger_config(10, "process"))
    writer_pids = process_writers.writer_process_pids

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
        metric_writers=process_writers,
        start_time=time.time(),
    )
    # (label, config, writers); per-backend variants reuse the process-mode writers, so
    # every variant logs into the same runs with ever-increasing steps.
    variants: list[tuple[str, Any, Any]] = [
        (f"process: {w.kind} only", every_step, MetricWriters([w])) for w in process_writers.writers
    ]
    variants += [
        (CONTROL, None, None),
        ("no backend (console line only)", every_step, MetricWriters([])),
        ("process: all four", every_step, process_writers),
        ("process: all four, every 10th", every_tenth, process_writers),
        ("inline: all four", inline_cfg, inline_writers),
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

    def block(step: Any, writers: Any = None) -> dict[str, float]:
        """Per-step seconds: wall (without / with the drain), CPU here, CPU of the writer."""
        child = _cpu_seconds(writer_pids)
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            step()
        steps_done = time.perf_counter()
        if writers is not None:
            writers.flush()
        drained = time.perf_counter()
        return {
            "wall": (steps_done - wall) / args.steps,
            "wall+drain": (drained - wall) / args.steps,
            "cpu": (time.process_time() - cpu) / args.steps,
            "writer cpu": (_cpu_seconds(writer_pids) - child) / args.steps,
        }

    bare: list[dict[str, float]] = []
    # (bare block, logged block) pairs measured back to back, per variant.
    pairs: dict[str, list[tuple[dict[str, float], dict[str, float]]]] = {
        label: [] for label, _, _ in variants
    }
    with contextlib.redirect_stdout(sink):
        for label, cfg, writers in variants:  # warm-up: allocator, first writes
            if writers is not None:
                for _ in range(3):
                    logged_step(label, cfg, writers)
                writers.flush()
        for label in in_log:
            in_log[label].clear()
        for round_ in range(args.rounds):
            # Rotate the order each round, so no variant always runs right after another.
            shift = round_ % len(variants)
            for label, cfg, writers in variants[shift:] + variants[:shift]:
                before = block(bench.step)
                bare.append(before)
                if writers is None:
                    run: Any = bench.step
                else:
                    run = functools.partial(logged_step, label, cfg, writers)
                pairs[label].append((before, block(run, writers)))
    closing = {}
    for name, writers in (("process", process_writers), ("inline", inline_writers)):
        started = time.perf_counter()
        writers.close()
        closing[name] = time.perf_counter() - started

    def median_ms(samples: list[dict[str, float]], key: str) -> float:
        return statistics.median(sample[key] for sample in samples) * 1e3

    def overhead(label: str, key: str, base_key: str | None = None) -> float:
        """Median over rounds of (logged block / the bare block just before it) - 1, in %.

        Pairing adjacent blocks cancels load that drifts over the run."""
        ratios = [after[key] / before[base_key or key] for before, after in pairs[label]]
        return 100 * (statistics.median(ratios) - 1)

    base = {key: median_ms(bare, key) for key in ("wall", "cpu")}
    print("logging overhead of bridge.logging.training_log, local / offline backends")
    print(
        f"machine: {os.cpu_count()} cores, load average {load_at_start:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end (other processes inflate wall times; CPU times "
        "are robust to them)"
    )
    print(
        "model: 2-layer transformer encoder (d_model 128, 4 heads, seq 64, batch 8), AdamW, "
        f"1 CPU thread: a bare step takes {base['wall']:.1f} ms wall, {base['cpu']:.1f} ms CPU"
    )
    print(
        f"{args.rounds} blocks of {args.steps} steps per variant, each right after a bare "
        "block, order rotating per round; overhead = median of (block / the bare block before "
        "it) - 1; CPU = the training process (all threads); the control row is the noise floor"
    )
    header = (
        f"{'variant':31s} {'wall':>7s} {'wall+drain':>11s} {'CPU':>7s} "
        f"{'writer CPU/step':>16s} {'in training_log':>16s}"
    )
    print(header)
    for label, _, _ in variants:
        samples = [after for _, after in pairs[label]]
        child = median_ms(samples, "writer cpu")
        inside = statistics.median(in_log[label]) * 1e3 if in_log[label] else 0.0
        print(
            f"{label:31s} {overhead(label, 'wall'):+6.1f}% "
            f"{overhead(label, 'wall+drain', 'wall'):+10.1f}% "
            f"{overhead(label, 'cpu'):+6.1f}% {child:13.2f} ms {inside:13.2f} ms"
        )
    print(
        "target: under 5% (printed, never asserted). 'writer CPU/step' is the metric writer "
        "process (process mode), which runs on another core."
    )
    print(
        f"building the writers: process mode {build_process_s:.1f} s, inline {build_inline_s:.1f} "
        f"s; closing: process {closing['process']:.1f} s, inline {closing['inline']:.1f} s; "
        f"output left in {root}"
    )


if __name__ == "__main__":
    main()
