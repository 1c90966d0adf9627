"""The GPU acceptance run: one prepared run that checks and measures the GPU path.

Each row runs in a process of its own with its own time limit (its steps in further
processes: the ``bridge-train`` command, or ``benchmarks/gpu/steps.py``), so a crash, an
out-of-memory error or a hang fails that row only; the rest go on. The report is one JSON
file with a ``rows`` list (each row's ``status`` is ``ran``, ``failed`` or
``not-run-here`` with its ``reason``) and the same as a Markdown table, written to
``--out`` (default ``$OUT``, else ``gpu-acceptance/``), with the versions used.

Rows (docs/gpu.md says what each measures and how to read it):

1. ``default_recipe``: the default recipe (``bridge-train``) on the GPU: nccl, world 1,
   megatron engine, local layers with torch SDPA attention, bf16 with fp32 main params,
   gradients reduced in fp32 and the distributed optimizer.
2. ``cpu_vs_gpu``: the same model on the CPU and the GPU of the same machine, same run:
   per-step losses agree (fp32 vs fp32 within 1e-4, bf16 vs fp32 within 1e-2 relative).
3. ``llama_1b``: a Llama-3.2-1B-shaped model, 20 steps at the largest micro batch that
   fits: tokens/s, TFLOP/s, MFU against a bf16 GEMM measured in the same run, peak memory,
   and the same steps in a bare megatron-core loop (framework overhead ratio).
4. ``checkpoint``: that model's checkpoint saved synchronously, loaded, and saved
   asynchronously with megatron-core's persistent worker: GB/s and time training blocks.
5. ``packed_sft`` (PackedSeqParams / THD when Transformer Engine is there, else the
   block-diagonal mask), ``lora``, and ``generate`` (``bridge-generate`` tokens/s, when that
   command is installed).
6. ``host_syncs``: host synchronisations per iteration, counted by CUDA's sync debug mode.

On the GPU machine (device tool; from the repository root, after
``python benchmarks/gpu/wheels.py --download .whl`` here, with ``carry: [".whl"]``), the
one line::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && PYTHONUNBUFFERED=1 python3 benchmarks/gpu_acceptance.py --out $OUT

Without a GPU, ``--dry-run`` runs every row that can run on the CPU at toy size (rows that
need CUDA are ``not-run-here``) and writes the same report::

    uv run python benchmarks/gpu_acceptance.py --dry-run --out /tmp/gpu-acceptance

Exit code: 0 when no row failed, 1 otherwise (the report is written either way).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "ROWS",
    "Row",
    "RowContext",
    "RowFailed",
    "RowNotRun",
    "format_markdown",
    "main",
    "run_acceptance",
    "training_flops_per_token",
]

ROOT = Path(__file__).resolve().parents[1]
STEPS_SCRIPT = ROOT / "benchmarks" / "gpu" / "steps.py"
STATUSES = ("ran", "failed", "not-run-here")

#: Relative bounds on per-step loss differences (row 2). fp32 on two devices differs only
#: by summation order; bf16 against fp32 measured at most 2.4e-3 on this recipe's 20 steps
#: on CPU (Nov 27), and 1e-2 is the bf16 bound of the layout tests (docs/engines.md).
FP32_BOUND = 1e-4
BF16_BOUND = 1e-2

#: Llama-3.2-1B's shape (1.24 B parameters with tied embeddings), and a toy of the same
#: family (RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases) for the dry run.
LLAMA_1B = {
    "num_layers": 16,
    "hidden_size": 2048,
    "ffn_hidden_size": 8192,
    "num_attention_heads": 32,
    "num_query_groups": 8,
    "kv_channels": 64,
    "seq_length": 2048,
    "vocab_size": 128256,
}
LLAMA_TOY = {
    "num_layers": 2,
    "hidden_size": 64,
    "ffn_hidden_size": 176,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "kv_channels": 16,
    "seq_length": 64,
    "vocab_size": 256,
}


class RowFailed(Exception):
    """A row's check or step failed; the message is the report's ``reason``."""


class RowNotRun(Exception):
    """A row (or the rest of it) cannot run here; the message is the report's ``reason``."""


@dataclasses.dataclass
class RowContext:
    """What a row's code gets: mode, scratch space, its deadline and the machine's facts.

    Attributes:
        mode: ``"gpu"`` or ``"dry"`` (CPU, toy sizes).
        scratch: A directory of the row's own.
        deadline: ``time.monotonic()`` by which the row must be done.
        environment: The ``env`` step's result.
        log: Where the row's steps write their output.
    """

    mode: str
    scratch: Path
    deadline: float
    environment: dict[str, Any]
    log: Path

    @property
    def gpu(self) -> bool:
        """Whether the row runs at full size on the GPU."""
        return self.mode == "gpu"

    def remaining(self) -> float:
        """Seconds left before the row's deadline."""
        return self.deadline - time.monotonic()

    def gpu_path(self) -> list[str]:
        """The overrides that put a recipe on the GPU path this run checks."""
        return [*precision_overrides("bf16"), *backend_overrides(self.mode)]

    def _run(self, argv: list[str], timeout: float, env: dict[str, str] | None) -> int:
        limit = max(1.0, min(timeout, self.remaining()))
        with self.log.open("a", encoding="utf-8") as log:
            log.write(f"\n$ {' '.join(argv)}\n")
            log.flush()
            proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_child_env(env),
                start_new_session=True,
            )
            try:
                return proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                raise RowFailed(f"{_short(argv)} timed out after {limit:.0f} s") from None

    def step(
        self, name: str, timeout: float, env: dict[str, str] | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        """Run ``benchmarks/gpu/steps.py NAME`` in its own process and return its result.

        Raises:
            RowFailed: The step failed (the reason is the last line of its traceback) or
                ran out of time.
        """
        result = self.scratch / f"{name}-{time.monotonic_ns()}.json"
        argv = [
            sys.executable,
            str(STEPS_SCRIPT),
            name,
            "--args",
            json.dumps(kwargs),
            "--result",
            str(result),
        ]
        code = self._run(argv, timeout, env)
        if code != 0 or not result.exists():
            raise RowFailed(f"step {name} failed (exit {code}): {_last_error(self.log)}")
        data: dict[str, Any] = json.loads(result.read_text(encoding="utf-8"))
        return data

    def cli(self, args: list[str], timeout: float, env: dict[str, str] | None = None) -> int:
        """Run the ``bridge-train`` command (``python -m bridge.train``); returns its exit code."""
        return self._run([sys.executable, "-m", "bridge.train", *args], timeout, env)


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of the report.

    Attributes:
        id: Short name (``--only`` takes it).
        title: What the row checks.
        run: The row's code; returns its measurements (a ``summary`` line included) or
            raises :class:`RowFailed` / :class:`RowNotRun`.
        limit_s: Time limit on the GPU machine.
        dry_limit_s: Time limit in the dry run.
        needs_cuda: Why the row cannot run without CUDA (``None``: it runs at toy size).
    """

    id: str
    title: str
    run: Callable[[RowContext], dict[str, Any]]
    limit_s: float
    dry_limit_s: float = 300.0
    needs_cuda: str | None = None


# -- overrides -------------------------------------------------------------------------------


def precision_overrides(precision: str) -> list[str]:
    """bf16 with fp32 main params (megatron's mixed-precision optimizer) and fp32 gradient
    reduction, as Megatron-LM runs bf16; or fp32. Both with the distributed optimizer and
    the local layers with torch SDPA attention."""
    common = [
        "model.layer_spec_backend=portable",
        "optimizer.use_distributed_optimizer=true",
        "ddp.use_distributed_optimizer=true",
    ]
    if precision == "fp32":
        return common
    return [
        *common,
        "model.bf16=true",
        "optimizer.bf16=true",
        "ddp.grad_reduce_in_fp32=true",
    ]


def backend_overrides(mode: str) -> list[str]:
    """nccl on the GPU; the recipes' gloo otherwise."""
    return ["dist.distributed_backend=nccl"] if mode == "gpu" else []


def model_overrides(shape: dict[str, int], on_gpu: bool) -> list[str]:
    """A Llama-family model of ``shape`` as overrides of the default recipe's model."""
    return [
        *(f"model.{k}={v}" for k, v in shape.items() if k != "vocab_size"),
        f"tokenizer.vocab_size={shape['vocab_size']}",
        "model.make_vocab_size_divisible_by=128",
        "model.position_embedding_type=rope",
        "model.rotary_base=500000",
        "model.normalization=RMSNorm",
        "model.gated_linear_unit=true",
        "model.activation_func=torch.nn.functional.silu",
        "model.add_bias_linear=false",
        "model.share_embeddings_and_output_weights=true",
        f"model.use_cpu_initialization={'false' if on_gpu else 'true'}",
    ]


def training_flops_per_token(shape: dict[str, int]) -> float:
    """Model FLOPs of one training token (forward + backward = 3 x forward).

    Matrix products of the layers and the output layer (2 FLOPs per multiply-add), and
    attention scores and context over the whole sequence (2 x 2 x s x heads x head_dim per
    token and layer, not halved for the causal mask, as Megatron and PaLM count it).
    """
    h, layers, s = shape["hidden_size"], shape["num_layers"], shape["seq_length"]
    heads, groups, d = shape["num_attention_heads"], shape["num_query_groups"], shape["kv_channels"]
    ffn = shape["ffn_hidden_size"]
    vocab = math.ceil(shape["vocab_size"] / 128) * 128
    per_layer = h * (heads * d + 2 * groups * d) + heads * d * h + 3 * h * ffn
    matmul = layers * per_layer + h * vocab
    attention = layers * 2 * s * heads * d
    return 3.0 * (2.0 * matmul + 2.0 * attention)


# -- rows ------------------------------------------------------------------------------------


def _metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]


def _losses(records: list[dict[str, Any]]) -> list[float]:
    return [float(r["lm loss"]) for r in records if "lm loss" in r]


def _check_losses(losses: list[float], what: str) -> None:
    if not losses:
        raise RowFailed(f"{what}: no lm loss was logged")
    if not all(math.isfinite(v) for v in losses):
        raise RowFailed(f"{what}: non-finite loss in {losses}")
    # One batch's loss is noisy (about +-0.1 on the SFT rows): compare the means of the
    # first and the last quarter of the steps, not two single steps.
    window = max(1, len(losses) // 4)
    first, last = statistics.fmean(losses[:window]), statistics.fmean(losses[-window:])
    if len(losses) > 1 and not last < first:
        raise RowFailed(
            f"{what}: the loss did not fall (mean of the first {window} steps {first:.4f}, "
            f"of the last {window} {last:.4f})"
        )


def _max_rel_diff(pairs: list[tuple[float, float]]) -> float | None:
    measured = [a for a, _ in pairs]
    reference = [b for _, b in pairs]
    return max(_relative_differences(measured, reference), default=None)


def _last(records: list[dict[str, Any]], key: str) -> Any:
    values = [r[key] for r in records if key in r]
    return values[-1] if values else None


def row_default_recipe(ctx: RowContext) -> dict[str, Any]:
    """Row 1: ``bridge-train`` with the default recipe on the GPU path."""
    metrics_file = ctx.scratch / "default_recipe.jsonl"
    size = [] if ctx.gpu else ["train.train_iters=4", "train.eval_iters=1"]
    start = time.monotonic()
    code = ctx.cli(
        [
            "--no-print-config",
            *ctx.gpu_path(),
            "logger.log_interval=1",
            "logger.log_memory_to_tensorboard=true",
            *size,
            "--metrics-file",
            str(metrics_file),
        ],
        timeout=ctx.remaining(),
    )
    wall = time.monotonic() - start
    if code != 0:
        raise RowFailed(f"bridge-train exited with {code}: {_last_error(ctx.log)}")
    records = _metrics(metrics_file)
    losses = _losses(records)
    _check_losses(losses, "default recipe")
    tokens = [r["throughput/tokens_per_sec"] for r in records if "throughput/tokens_per_sec" in r]
    steady = tokens[len(tokens) // 2 :] or tokens
    result = {
        "iterations": len(losses),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "validation_loss": _last(records, "lm loss validation"),
        "tokens_per_s": sum(steady) / len(steady) if steady else None,
        "peak_allocated_gb": _last(records, "memory/peak_allocated_mem"),
        "wall_seconds": wall,
    }
    result["summary"] = (
        f"{len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}"
        + (f", {result['tokens_per_s']:.0f} tokens/s" if result["tokens_per_s"] else "")
        + (f", peak {result['peak_allocated_gb']:.2f} GB" if result["peak_allocated_gb"] else "")
    )
    return result


def _relative_differences(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True)]


def row_cpu_vs_gpu(ctx: RowContext) -> dict[str, Any]:
    """Row 2: per-step losses of the same model on this machine's CPU and its GPU."""
    steps = [
        "train.train_iters=20",
        "train.eval_iters=0",
        "logger.log_interval=1",
        "--no-print-config",
    ]
    runs = {
        "cpu_fp32": (["gloo"], "fp32", {"CUDA_VISIBLE_DEVICES": ""}),
        "gpu_fp32": (["nccl"], "fp32", None),
        "gpu_bf16": (["nccl"], "bf16", None),
    }
    losses: dict[str, list[float]] = {}
    for name, (backend, precision, env) in runs.items():
        metrics_file = ctx.scratch / f"{name}.jsonl"
        code = ctx.cli(
            [
                *steps,
                *precision_overrides(precision),
                f"dist.distributed_backend={backend[0]}",
                "--metrics-file",
                str(metrics_file),
            ],
            timeout=ctx.remaining(),
            env=env,
        )
        if code != 0:
            raise RowFailed(f"{name}: bridge-train exited with {code}: {_last_error(ctx.log)}")
        losses[name] = _losses(_metrics(metrics_file))
        _check_losses(losses[name], name)
    fp32 = _relative_differences(losses["gpu_fp32"], losses["cpu_fp32"])
    bf16 = _relative_differences(losses["gpu_bf16"], losses["cpu_fp32"])
    result = {
        "losses": losses,
        "max_rel_diff_fp32": max(fp32),
        "max_rel_diff_bf16": max(bf16),
        "bound_fp32": FP32_BOUND,
        "bound_bf16": BF16_BOUND,
        "summary": (
            f"max relative loss difference vs CPU fp32 over 20 steps: GPU fp32 {max(fp32):.2e} "
            f"(bound {FP32_BOUND:g}), GPU bf16 {max(bf16):.2e} (bound {BF16_BOUND:g})"
        ),
    }
    problems = []
    if max(fp32) > FP32_BOUND:
        problems.append(f"GPU fp32 differs from CPU fp32 by {max(fp32):.2e} > {FP32_BOUND:g}")
    if max(bf16) > BF16_BOUND:
        problems.append(f"GPU bf16 differs from CPU fp32 by {max(bf16):.2e} > {BF16_BOUND:g}")
    if problems:
        raise RowFailed("; ".join(problems) + f" (losses: {json.dumps(losses)})")
    return result


def _llama_overrides(ctx: RowContext, micro: int, steps: int) -> tuple[dict[str, int], list[str]]:
    shape = LLAMA_1B if ctx.gpu else LLAMA_TOY
    overrides = [
        *model_overrides(shape, ctx.gpu),
        *ctx.gpu_path(),
        f"train.train_iters={steps}",
        f"train.micro_batch_size={micro}",
        f"train.global_batch_size={micro}",
        "train.eval_iters=0",
        "logger.log_interval=10",
        # megatron's own initialisation on both sides: the bare loop builds the model with
        # megatron-core alone, and the two runs' losses are compared.
        "rng.layout_independent_init=false",
    ]
    return shape, overrides


def row_llama_1b(ctx: RowContext) -> dict[str, Any]:
    """Row 3: the 1B model's throughput, MFU and memory, trainer against a bare loop."""
    steps, warmup = (20, 5) if ctx.gpu else (6, 2)
    result: dict[str, Any] = {"parts_not_run": {}}
    peak = None
    if ctx.gpu:
        gemm = ctx.step("gemm", timeout=90)
        peak = gemm["tflops_mean"]
        result["gemm_bf16_tflops"] = peak
        _, probe_overrides = _llama_overrides(ctx, 1, 2)
        probe = ctx.step(
            "probe",
            timeout=150,
            recipe="tiny_gpt",
            overrides=probe_overrides,
            candidates=[1, 2, 4, 8, 16, 32],
            memory_fraction=0.9,
        )
        result["probe"] = probe["tried"]
        micro = probe["micro_batch_size"]
        if micro is None:
            raise RowFailed(f"not even micro batch 1 fits: {probe['tried']}")
    else:
        micro = 2
        reason = "needs CUDA (GEMM peak, memory probe)"
        result["parts_not_run"].update(gemm_peak=reason, micro_batch_probe=reason)
    # The trainer holds a few buffers the bare loop does not: if it runs out of memory at
    # the probed size, both sides run again at the next smaller size that fitted.
    fitted = [t["micro_batch_size"] for t in result.get("probe", []) if t.get("fits")]
    sizes = [micro, *[m for m in reversed(fitted) if m < micro][:1]]
    for attempt, micro in enumerate(sizes):
        shape, overrides = _llama_overrides(ctx, micro, steps)
        try:
            bare = ctx.step(
                "bare", timeout=150, recipe="tiny_gpt", overrides=overrides, warmup=warmup
            )
            trainer = ctx.step(
                "trainer",
                timeout=180,
                recipe="tiny_gpt",
                overrides=overrides,
                warmup=warmup,
                metrics_file=str(ctx.scratch / f"llama_trainer_{micro}.jsonl"),
            )
            break
        except RowFailed as exc:
            if attempt + 1 == len(sizes) or "out of memory" not in str(exc).lower():
                raise
            result.setdefault("out_of_memory_at", []).append(
                {"micro_batch_size": micro, "error": str(exc)}
            )
    if trainer["exit_code"] != 0:
        raise RowFailed(f"pretrain exited with {trainer['exit_code']}")
    _check_losses(trainer["losses"], "trainer")
    _check_losses(bare["losses"], "bare loop")
    tokens_per_step = micro * shape["seq_length"]
    flops_per_step = training_flops_per_token(shape) * tokens_per_step
    for side, data in (("bare", bare), ("trainer", trainer)):
        seconds = data["step_seconds"]
        result[side] = {
            "step_seconds": seconds,
            "tokens_per_s": tokens_per_step / seconds,
            "model_tflops": flops_per_step / seconds / 1e12,
            "memory": data["memory"],
            "first_loss": data["losses"][0],
            "last_loss": data["losses"][-1],
            # Kept whole: the first GPU run's sides differed by up to 7% on one step, and
            # without the curves nondeterminism could not be told from a real difference.
            "losses": data["losses"],
        }
    result["trainer"]["loss_steps"] = trainer["loss_steps"]
    result.update(
        parameters=bare["parameters"],
        micro_batch_size=micro,
        seq_length=shape["seq_length"],
        steps=steps,
        timed_steps=steps - warmup,
        framework_overhead_ratio=trainer["step_seconds"] / bare["step_seconds"],
        trainer_reported_tflops=(trainer["reported_tflops"] or [None])[-1],
    )
    # Both sides train the same model on the same data with the same optimizer and schedule;
    # their losses should agree to rounding (not asserted: a different initialisation
    # order on the GPU would be no framework cost, only a weaker cross-check).
    # The trainer logs some iterations (by its step number); the bare loop keeps all.
    pairs = [
        (loss, bare["losses"][step - 1])
        for step, loss in zip(trainer["loss_steps"], trainer["losses"], strict=True)
        if 1 <= step <= len(bare["losses"])
    ]
    result["trainer_vs_bare_max_rel_loss_diff"] = _max_rel_diff(pairs)
    if ctx.gpu and ctx.remaining() > 60:
        # The floor for the comparison above: the bare loop against itself. On a GPU some
        # kernels (the embedding's backward, for one) add in a different order every run,
        # and 20 steps from a loss of 12 amplify that.
        again = ctx.step("bare", timeout=150, recipe="tiny_gpt", overrides=overrides, warmup=warmup)
        result["bare_repeat_losses"] = again["losses"]
        result["bare_vs_bare_max_rel_loss_diff"] = _max_rel_diff(
            list(zip(again["losses"], bare["losses"], strict=False))
        )
    else:
        result["parts_not_run"]["bare_repeat"] = (
            "needs CUDA (on the CPU the bare loop is deterministic)"
            if not ctx.gpu
            else "out of time"
        )
    mfu = ""
    if peak:
        result["mfu_vs_measured_gemm"] = result["trainer"]["model_tflops"] / peak
        result["bare_mfu_vs_measured_gemm"] = result["bare"]["model_tflops"] / peak
        mfu = f", MFU {result['mfu_vs_measured_gemm']:.1%} of the measured {peak:.0f} TFLOP/s GEMM"
    memory = trainer["memory"]
    result["summary"] = (
        f"{bare['parameters'] / 1e9:.2f} B params, micro batch {micro} x {shape['seq_length']}: "
        f"trainer {result['trainer']['tokens_per_s']:.0f} tokens/s, "
        f"{result['trainer']['model_tflops']:.1f} TFLOP/s{mfu}; "
        f"trainer/bare step time {result['framework_overhead_ratio']:.3f}"
        + (f"; peak {memory['peak_allocated_gb']:.1f} GB" if memory else "")
        + f"; loss vs bare max rel diff {result['trainer_vs_bare_max_rel_loss_diff']:.2g}"
        + (
            f" (bare vs itself {result['bare_vs_bare_max_rel_loss_diff']:.2g})"
            if result.get("bare_vs_bare_max_rel_loss_diff") is not None
            else ""
        )
    )
    return result


def row_checkpoint(ctx: RowContext) -> dict[str, Any]:
    """Row 4: synchronous save, load and asynchronous save of the 1B model."""
    shape = LLAMA_1B if ctx.gpu else LLAMA_TOY
    if ctx.gpu:
        # bf16 parameters + fp32 main parameters + two fp32 Adam moments: 14 bytes per
        # parameter; run B holds two checkpoints at once (run A's is deleted once loaded).
        need = 2.2 * 14 * 1.24e9 / 1e9
        free = _filesystem(ctx.scratch)["free_gb"]
        if free < need:
            raise RowNotRun(f"needs about {need:.0f} GB free for two checkpoints; {free} GB free")
    micro = 2
    overrides = [
        *model_overrides(shape, ctx.gpu),
        *ctx.gpu_path(),
        f"train.micro_batch_size={micro}",
        f"train.global_batch_size={micro}",
        "train.eval_iters=0",
        "logger.log_interval=10",
    ]
    data = ctx.step(
        "checkpoint",
        timeout=ctx.remaining(),
        recipe="tiny_gpt",
        overrides=overrides,
        scratch=str(ctx.scratch),
        interval=20 if ctx.gpu else 3,
        metrics_file=str(ctx.scratch / "checkpoint.jsonl"),
        # On the CPU a toy save takes milliseconds: the projection would only measure load.
        budget_s=ctx.remaining() - 10 if ctx.gpu else None,
    )
    gb = data["checkpoint_bytes"] / 1e9
    sync = data["sync_save_logged_seconds"] or data["sync_save_blocked_seconds"]
    load = data["load_logged_seconds"]
    blocking = data["async_save_blocking_seconds"]
    async_blocked = None if blocking is None else blocking + data["async_slower_steps_seconds"]
    sync_blocked = data["sync_save_blocked_seconds"]
    result = dict(data)
    result.update(
        checkpoint_gb=gb,
        sync_save_gb_per_s=gb / sync if sync else None,
        load_gb_per_s=gb / load if load else None,
        async_blocked_seconds=async_blocked,
        async_blocked_vs_sync=async_blocked / sync_blocked
        if async_blocked is not None and sync_blocked > 0
        else None,
        async_write_gb_per_s=gb / data["async_write_seconds"]
        if data["async_write_seconds"]
        else None,
        parts_not_run={}
        if data["async_overlap_measured"]
        else {
            "async_overlap": "out of time: run B saved once, at its end, so the asynchronous "
            "save's blocking part is not told apart from its write"
        },
    )
    if data["async_commits"] != data["async_saves_planned"]:
        raise RowFailed(
            f"{data['async_commits']} asynchronous saves were committed, "
            f"expected {data['async_saves_planned']}"
        )

    def rate(value: float | None) -> str:
        return f"{value:.2f} GB/s" if value else "n/a"

    if async_blocked is not None:
        share = result["async_blocked_vs_sync"]
        asynchronous = f"async blocks training {async_blocked:.2f} s" + (
            f" ({share:.1%} of the sync save)" if share is not None else ""
        )
    else:
        asynchronous = f"async save to commit {data['async_end_wait_seconds'] or 0:.2f} s"
    result["summary"] = (
        f"{gb:.2f} GB: sync save {sync:.2f} s ({rate(result['sync_save_gb_per_s'])}), "
        f"load {rate(result['load_gb_per_s'])}, {asynchronous}, async write "
        f"{rate(result['async_write_gb_per_s'])}"
    )
    return result


def _sft_common(ctx: RowContext, steps: int) -> list[str]:
    return [
        *ctx.gpu_path(),
        f"train.train_iters={steps}",
        "train.eval_iters=1",
        f"train.eval_interval={steps}",
        "logger.log_interval=1",
        f"dataset.dataset_kwargs={{cache_dir: {ctx.scratch / 'sft_cache'}}}",
    ]


def row_packed_sft(ctx: RowContext) -> dict[str, Any]:
    """Row 5a: packed SFT (PackedSeqParams / THD with Transformer Engine, else the mask)."""
    te = bool(ctx.environment.get("transformer_engine"))
    overrides = [
        *_sft_common(ctx, 30 if ctx.gpu else 4),
        "dataset.packed_sequence_specs={packed_sequence_size: 128}",
        "train.micro_batch_size=1",
        "checkpoint.save=null",
    ]
    result: dict[str, Any] = {"parts_not_run": {}}
    if te and ctx.gpu:
        overrides.append("model.layer_spec_backend=transformer_engine")
        result["attention"] = "Transformer Engine, PackedSeqParams (qkv_format thd)"
    else:
        result["attention"] = "torch SDPA with the block-diagonal mask (portable layer spec)"
        result["parts_not_run"]["thd"] = (
            "Transformer Engine not installed: PackedSeqParams (THD) needs its attention; "
            "the portable spec packs with a block-diagonal mask"
        )
    data = ctx.step(
        "finetune",
        timeout=ctx.remaining(),
        recipe="sft",
        overrides=overrides,
        metrics_file=str(ctx.scratch / "packed_sft.jsonl"),
    )
    if data["exit_code"] != 0:
        raise RowFailed(f"pretrain exited with {data['exit_code']}")
    _check_losses(data["losses"], "packed SFT")
    result.update(data)
    tokens = data["reported_tokens_per_s"]
    result["tokens_per_s"] = tokens[-1] if tokens else None
    result["summary"] = (
        f"{data['steps']} steps ({result['attention']}), loss {data['losses'][0]:.3f} -> "
        f"{data['losses'][-1]:.3f}"
        + (f", {result['tokens_per_s']:.0f} tokens/s" if result["tokens_per_s"] else "")
    )
    return result


def row_lora(ctx: RowContext) -> dict[str, Any]:
    """Row 5b: LoRA (``sft_lora`` recipe) on an SFT base trained first in the same step."""
    steps = 30 if ctx.gpu else 3
    base_dir = ctx.scratch / "sft_base"
    base = {
        "recipe": "sft",
        "overrides": [
            *_sft_common(ctx, steps),
            # LoRA leaves the tied embedding / output layer frozen: with megatron's default
            # init (std 0.02) a short base caps every logit near 3 and LoRA cannot learn the
            # answers (docs/finetuning.md; the first GPU run failed this row so). The
            # learning test's base is initialised the same way.
            "model.init_method_std=0.2",
            f"checkpoint.save={base_dir}",
            "checkpoint.save_interval=null",
        ],
    }
    overrides = [
        *_sft_common(ctx, steps),
        f"checkpoint.pretrained_checkpoint={base_dir}",
        f"checkpoint.save={ctx.scratch / 'lora'}",
        "checkpoint.save_interval=null",
    ]
    data = ctx.step(
        "finetune",
        timeout=ctx.remaining(),
        recipe="sft_lora",
        overrides=overrides,
        metrics_file=str(ctx.scratch / "lora.jsonl"),
        base=base,
    )
    if data["exit_code"] != 0:
        raise RowFailed(f"pretrain exited with {data['exit_code']}")
    _check_losses(data["losses"], "LoRA")
    before, after = data.get("base_validation_loss"), data.get("validation_loss")
    if before is None or after is None:
        raise RowFailed("LoRA: the base or the LoRA run logged no validation loss")
    if not after < before:
        raise RowFailed(
            f"LoRA: the validation loss did not fall below its base's ({before:.4f} -> {after:.4f})"
        )
    result = dict(data)
    result["summary"] = (
        f"{data['steps']} LoRA steps on a {steps}-step SFT base, loss {data['losses'][0]:.3f} "
        f"-> {data['losses'][-1]:.3f}, validation {before:.3f} -> {after:.3f}"
    )
    return result


def _generate_entry_point() -> str | None:
    from importlib.metadata import entry_points

    for ep in entry_points(group="console_scripts"):
        if ep.name == "bridge-generate":
            return str(ep.value)
    return None


def row_generate(ctx: RowContext) -> dict[str, Any]:
    """Row 5c: ``bridge-generate`` tokens/s on a short SFT checkpoint, when it is installed.

    The command runs once (8 new tokens a prompt, checked); the decode rate is timed inside
    one process by ``steps.py generate``: greedy generations of 8 and 64 new tokens, the
    difference of their median times over the difference of their new tokens.
    """
    target = _generate_entry_point()
    if target is None:
        raise RowNotRun("bridge-generate not installed")
    module, _, function = target.partition(":")
    checkpoint = ctx.scratch / "gen_base"
    code = ctx.cli(
        [
            "--recipe",
            "sft",
            "--no-print-config",
            *_sft_common(ctx, 20 if ctx.gpu else 3),
            f"checkpoint.save={checkpoint}",
            "checkpoint.save_interval=null",
        ],
        timeout=ctx.remaining(),
    )
    if code != 0:
        raise RowFailed(f"the checkpoint run exited with {code}")
    prompts = ["What is 3+4? ", "What is 5+2? ", "What is 1+1? ", "What is 9+0? "]
    # The command itself, once: it loads the checkpoint and prints exactly what it was
    # asked for.
    new = 8
    output = ctx.scratch / "generate.jsonl"
    call = f"import sys; sys.argv[0] = 'bridge-generate'; from {module} import {function} as f; sys.exit(f())"
    argv = [sys.executable, "-c", call, str(checkpoint)]
    argv += [a for p in prompts for a in ("--prompt", p)]
    # Exactly `new` tokens a prompt: where a tiny model ends its answer is not the point.
    argv += ["--max-new-tokens", str(new), "--greedy", "--ignore-eod", "--json"]
    start = time.monotonic()
    with output.open("w", encoding="utf-8") as out:
        proc = subprocess.run(
            argv,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
            env=_child_env(None),
            timeout=max(1.0, ctx.remaining()),
            check=False,
        )
    command_seconds = time.monotonic() - start
    if proc.returncode != 0:
        raise RowFailed(
            f"bridge-generate exited with {proc.returncode}: {proc.stderr.strip()[-300:]}"
        )
    answers = [
        json.loads(x) for x in output.read_text(encoding="utf-8").splitlines() if x.startswith("{")
    ]
    printed = sum(len(a.get("token_ids", [])) for a in answers)
    if printed != new * len(prompts):
        raise RowFailed(
            f"bridge-generate printed {printed} new tokens, expected {new * len(prompts)}"
        )
    # The rate, inside one process (start-up and loading out of it).
    data = ctx.step(
        "generate",
        timeout=ctx.remaining(),
        checkpoint=str(checkpoint),
        prompts=prompts,
        new_tokens=[8, 64],
    )
    expected = {str(n): n * len(prompts) for n in (8, 64)}
    got = {str(k): v for k, v in data["tokens"].items()}
    if got != expected:
        raise RowFailed(f"generated {got} new tokens, expected {expected}")
    result: dict[str, Any] = dict(data)
    result["command_seconds"] = command_seconds
    rate = data["decode_tokens_per_s"]
    if rate is None:
        # A toy model on a CPU under load: 56 more decode steps can take less time than the
        # medians vary; on the GPU the rate must be measurable.
        reason = f"the longer generation was not slower (median seconds {data['median_seconds']})"
        if ctx.gpu:
            raise RowFailed(f"cannot measure the decode rate: {reason}")
        result["parts_not_run"] = {"decode_rate": reason}
        result["summary"] = (
            f"bridge-generate printed {printed} tokens; decode rate not measurable here"
        )
        return result
    result["summary"] = (
        f"{rate:.0f} new tokens/s over {len(prompts)} prompts "
        f"({data['decode_step_ms']:.1f} ms per decode step; greedy, 64 vs 8 new tokens, "
        f"one process); bridge-generate command {command_seconds:.1f} s"
    )
    return result


def row_host_syncs(ctx: RowContext) -> dict[str, Any]:
    """Row 6: host synchronisations per iteration (``benchmarks/host_syncs.py``'s windows)."""
    data = ctx.step(
        "host_syncs",
        timeout=ctx.remaining(),
        overrides=ctx.gpu_path(),
        log_interval=10 if ctx.gpu else 2,
    )
    result: dict[str, Any] = dict(data)
    quiet = data["windows"]["iteration without a log line"]
    logged = data["windows"]["iteration with a log line"]
    if ctx.gpu:
        result["summary"] = (
            f"synchronising CUDA calls: {quiet['cuda_synchronizing_calls']} per iteration without "
            f"a log line, {logged['cuda_synchronizing_calls']} with one (goal <= 5 without); "
            f"host-value requests {quiet['host_value_requests']} / {logged['host_value_requests']}"
        )
    else:
        result["parts_not_run"] = {"cuda_sync_debug_mode": "needs CUDA"}
        result["summary"] = (
            f"host-value requests (TorchFunctionMode count): {quiet['host_value_requests']} per "
            f"iteration without a log line, {logged['host_value_requests']} with one"
        )
    return result


ROWS: tuple[Row, ...] = (
    Row(
        "default_recipe",
        "1. default recipe: nccl world 1, megatron engine, local layers + torch SDPA, bf16 "
        "(fp32 main params), distributed optimizer",
        row_default_recipe,
        limit_s=90,
    ),
    Row(
        "cpu_vs_gpu",
        "2. same model on CPU and GPU: per-step losses within fp32 / bf16 bounds",
        row_cpu_vs_gpu,
        limit_s=120,
        needs_cuda="needs CUDA: compares GPU losses with CPU losses computed in the same run",
    ),
    Row(
        "llama_1b",
        "3. Llama-1B shape, largest micro batch: tokens/s, TFLOP/s, MFU, memory, vs bare loop",
        row_llama_1b,
        limit_s=240,
    ),
    Row(
        "checkpoint",
        "4. checkpoint of that model: sync save, load, async save (persistent worker)",
        row_checkpoint,
        # The first GPU run's synchronous save of 17 GB took 53 s, and 200 s left no room
        # for the two asynchronous saves whose overlap with training the row measures.
        limit_s=280,
    ),
    Row(
        "packed_sft",
        "5a. packed SFT (PackedSeqParams / THD if supported)",
        row_packed_sft,
        limit_s=60,
    ),
    Row("lora", "5b. LoRA on an SFT base", row_lora, limit_s=90),
    Row("generate", "5c. bridge-generate tokens/s", row_generate, limit_s=60),
    Row("host_syncs", "6. host syncs per iteration, counted on CUDA", row_host_syncs, limit_s=60),
)

#: The order rows run on the GPU machine: cheap and essential first, the disk-heavy
#: checkpoint row last, so that a run cut short by its time budget loses the least.
GPU_ORDER = (
    "default_recipe",
    "cpu_vs_gpu",
    "llama_1b",
    "host_syncs",
    "packed_sft",
    "lora",
    "generate",
    "checkpoint",
)

# Rows need this much of their limit to start at all (else: not-run-here, out of budget).
_MIN_START_S = 20.0


# -- processes -------------------------------------------------------------------------------


def _child_env(extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    # Let Python cache bytecode: without it every process recompiles megatron-core (~2x the
    # start-up), and this run starts many.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONUNBUFFERED"] = "1"
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update(extra or {})
    return env


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _short(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        if arg.endswith("steps.py") and i + 1 < len(argv):
            return f"step {argv[i + 1]}"
    return "bridge-train" if "bridge.train" in argv else argv[0]


def _last_error(log: Path, limit: int = 400) -> str:
    """The last error-looking line of a log (a traceback's last line, an error message)."""
    if not log.exists():
        return "(no output)"
    lines = [
        x.strip()
        for x in log.read_text(encoding="utf-8", errors="replace").splitlines()
        if x.strip()
    ]
    for line in reversed(lines):
        if any(word in line for word in ("Error", "error", "Exception", "Killed", "refused")):
            return line[:limit]
    return lines[-1][:limit] if lines else "(no output)"


def _tail(path: Path, chars: int = 3000) -> str:
    if not path.exists():
        return ""
    text = path.read_text(encoding="utf-8", errors="replace")
    return text[-chars:]


# -- running rows ----------------------------------------------------------------------------


def row_limit(row: Row, mode: str, remaining: float, *, alone: bool) -> float:
    """The time a row may take when it starts with ``remaining`` seconds of the budget left.

    A row's own limit shares the budget among the rows; a row run alone (``--only`` one
    row) has whatever is left of the budget, so that a re-check can give a slow part
    (the checkpoint row's asynchronous overlap) the time the full run could not.
    """
    if alone:
        return remaining
    return min(row.limit_s if mode == "gpu" else row.dry_limit_s, remaining)


def _row_by_id(row_id: str) -> Row:
    for row in ROWS:
        if row.id == row_id:
            return row
    raise KeyError(f"unknown row {row_id!r}; rows: {[r.id for r in ROWS]}")


def run_row_here(
    row_id: str, mode: str, scratch: Path, limit_s: float, environment: dict[str, Any], log: Path
) -> dict[str, Any]:
    """Run one row's code in this process (the row's own process); returns its report entry."""
    row = _row_by_id(row_id)
    ctx = RowContext(mode, scratch, time.monotonic() + limit_s, environment, log)
    try:
        data = row.run(ctx)
    except RowNotRun as exc:
        return {"status": "not-run-here", "reason": str(exc)}
    except RowFailed as exc:
        return {"status": "failed", "reason": str(exc)}
    except Exception as exc:  # a bug in the row's own code is a failed row, not a crash
        import traceback

        traceback.print_exc()
        return {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
    return {"status": "ran", "reason": None, "summary": data.pop("summary", ""), "metrics": data}


def _run_row_process(
    row: Row, mode: str, scratch: Path, limit: float, env_file: Path
) -> dict[str, Any]:
    """Run ``row`` in a process of its own, killed (with its steps) after ``limit`` seconds."""
    row_dir = scratch / row.id
    row_dir.mkdir(parents=True, exist_ok=True)
    result_file = row_dir / "result.json"
    log = row_dir / "row.log"
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--row",
        row.id,
        "--mode",
        mode,
        "--scratch",
        str(row_dir),
        "--limit-s",
        str(limit),
        "--env-file",
        str(env_file),
        "--result",
        str(result_file),
        "--log",
        str(log),
    ]
    start = time.monotonic()
    with (row_dir / "process.log").open("w", encoding="utf-8") as out:
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_child_env(None),
            start_new_session=True,
        )
        try:
            # A little over the row's own deadline: the row reports its own timeouts.
            proc.wait(timeout=limit + 15)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
    seconds = time.monotonic() - start
    if result_file.exists():
        entry: dict[str, Any] = json.loads(result_file.read_text(encoding="utf-8"))
    else:
        entry = {
            "status": "failed",
            "reason": f"the row's process ended without a result (exit {proc.returncode}; limit {limit:.0f} s): {_last_error(row_dir / 'process.log')}",
        }
    entry["seconds"] = round(seconds, 1)
    entry["log_tail"] = _tail(log) or _tail(row_dir / "process.log")
    return entry


def _environment(mode: str, scratch: Path) -> dict[str, Any]:
    result = scratch / "env.json"
    argv = [sys.executable, str(STEPS_SCRIPT), "env", "--result", str(result)]
    env = _child_env({"CUDA_VISIBLE_DEVICES": ""} if mode == "dry" else None)
    proc = subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, env=env, timeout=120, check=False
    )
    if proc.returncode != 0 or not result.exists():
        return {"error": (proc.stderr or proc.stdout).strip()[-1000:]}
    data: dict[str, Any] = json.loads(result.read_text(encoding="utf-8"))
    data["bridge_generate"] = _generate_entry_point()
    return data


def _filesystem(path: Path) -> dict[str, Any]:
    """Where ``path`` lives: the mount's filesystem type and the free space (GB).

    Checkpoint rates mean little without it (a tmpfs is memory, not a disk).
    """
    import shutil

    resolved = str(path.resolve())
    fstype, mount = None, ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text(encoding="utf-8").splitlines():
            fields = line.split()
            if len(fields) < 3:
                continue
            point = fields[1]
            inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(mount):
                mount, fstype = point, fields[2]
    return {
        "path": resolved,
        "mount": mount or None,
        "filesystem": fstype,
        "free_gb": round(shutil.disk_usage(path).free / 1e9, 1),
    }


def run_acceptance(
    mode: str, out: Path, scratch: Path, only: list[str] | None, budget_s: float, jobs: int
) -> dict[str, Any]:
    """Run the rows and write ``report.json``, ``report.md`` and ``rows.log`` under ``out``.

    Returns:
        The report.
    """
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    scratch.mkdir(parents=True, exist_ok=True)
    environment = _environment(mode, scratch)
    environment["scratch"] = _filesystem(scratch)
    env_file = scratch / "environment.json"
    env_file.write_text(json.dumps(environment), encoding="utf-8")
    selected = [r for r in ROWS if only is None or r.id in only]
    order = sorted(selected, key=lambda r: GPU_ORDER.index(r.id))
    entries: dict[str, dict[str, Any]] = {}
    runnable: list[Row] = []
    for row in order:
        if mode == "gpu" and not environment.get("cuda_available"):
            entries[row.id] = {
                "status": "not-run-here",
                "reason": "torch.cuda.is_available() is False on this machine (use --dry-run)",
            }
        elif mode == "dry" and row.needs_cuda is not None:
            entries[row.id] = {"status": "not-run-here", "reason": row.needs_cuda}
        elif row.id == "generate" and environment.get("bridge_generate") is None:
            entries[row.id] = {"status": "not-run-here", "reason": "bridge-generate not installed"}
        else:
            runnable.append(row)
    deadline = started + budget_s

    def launch(row: Row) -> tuple[str, dict[str, Any]]:
        remaining = deadline - time.monotonic()
        limit = row_limit(row, mode, remaining, alone=len(runnable) == 1)
        if limit < _MIN_START_S:
            return row.id, {
                "status": "not-run-here",
                "reason": f"out of the run's time budget ({budget_s:.0f} s; {max(remaining, 0):.0f} s left)",
            }
        print(f"[gpu_acceptance] {row.id}: running (limit {limit:.0f} s)", flush=True)
        entry = _run_row_process(row, mode, scratch, limit, env_file)
        print(
            f"[gpu_acceptance] {row.id}: {entry['status']} in {entry['seconds']} s {entry.get('summary') or entry.get('reason') or ''}",
            flush=True,
        )
        return row.id, entry

    if jobs > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for row_id, entry in pool.map(launch, runnable):
                entries[row_id] = entry
    else:
        for row in runnable:
            row_id, entry = launch(row)
            entries[row_id] = entry
    rows = []
    for row in selected:
        entry = {"id": row.id, "title": row.title, **entries[row.id]}
        entry.setdefault("reason", None)
        rows.append(entry)
    report = {
        "schema": 1,
        "mode": "gpu" if mode == "gpu" else "dry-run",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "budget_s": budget_s,
        "elapsed_s": round(time.monotonic() - started, 1),
        "environment": environment,
        "rows": rows,
    }
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
    (out / "report.md").write_text(format_markdown(report), encoding="utf-8")
    with (out / "rows.log").open("w", encoding="utf-8") as log:
        for row in selected:
            for name in ("process.log", "row.log"):
                path = scratch / row.id / name
                if path.exists():
                    log.write(f"\n===== {row.id}: {name} =====\n")
                    log.write(path.read_text(encoding="utf-8", errors="replace")[-200_000:])
    return report


def format_markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: versions, then one table row per report row."""
    env = report["environment"]
    versions = env.get("versions", {})
    lines = [
        f"# GPU acceptance run ({report['mode']}, {report['date']})",
        "",
        f"- command: `{report['command']}`",
        f"- GPU: {env.get('gpu', 'none')} ({env.get('gpu_memory_gb', '-')} GB), driver "
        f"{env.get('driver', '-')}, CUDA (torch build) {env.get('torch_cuda', '-')}",
        f"- torch {env.get('torch', '-')}, megatron-core {versions.get('megatron-core', '-')}, "
        f"bridge-train {versions.get('bridge-train', '-')}, Python {env.get('python', '-')}, "
        f"Transformer Engine {'yes' if env.get('transformer_engine') else 'no'}",
        f"- bridge.train imported from: {env.get('bridge_train_from', '-')}",
        f"- unmet requirements: {', '.join(env.get('unmet_requirements', [])) or 'none'}",
        f"- scratch: {env.get('scratch', {}).get('filesystem', '-')} at "
        f"{env.get('scratch', {}).get('mount', '-')}, {env.get('scratch', {}).get('free_gb', '-')} GB free",
        f"- elapsed {report['elapsed_s']} s (budget {report['budget_s']:.0f} s)",
        "",
        "| row | status | result | s |",
        "| --- | --- | --- | --- |",
    ]
    for row in report["rows"]:
        text = row.get("summary") or row.get("reason") or ""
        parts = (row.get("metrics") or {}).get("parts_not_run") or {}
        if parts:
            text += " (not run here: " + "; ".join(f"{k}: {v}" for k, v in parts.items()) + ")"
        text = text.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {row['title']} | {row['status']} | {text} | {row.get('seconds', '')} |")
    if "error" in env:
        lines += ["", f"environment probe failed: {env['error']}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Command line: the whole run, or (``--row``) one row inside its own process."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="CPU, toy sizes; rows needing CUDA are not run"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="report directory (default: $OUT, else gpu-acceptance/)",
    )
    parser.add_argument(
        "--scratch", type=Path, default=None, help="working directory (default: a temporary one)"
    )
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated row ids to run (default: all); one row alone has the whole budget",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="time for the whole run (default: 520 s on the GPU, 900 s in the dry run)",
    )
    parser.add_argument(
        "--jobs", type=int, default=None, help="rows at a time (dry run default 2, GPU 1)"
    )
    parser.add_argument("--list", action="store_true", help="list the rows and exit")
    # One row inside its own process (used by the run itself).
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--limit-s", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--env-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--log", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.list:
        for row in ROWS:
            print(f"{row.id:16s} {row.title}")
        return
    if args.row is not None:
        environment = json.loads(args.env_file.read_text(encoding="utf-8"))
        entry = run_row_here(args.row, args.mode, args.scratch, args.limit_s, environment, args.log)
        args.result.write_text(json.dumps(entry, indent=1, default=str), encoding="utf-8")
        return
    mode = "dry" if args.dry_run else "gpu"
    out = args.out or Path(os.environ.get("OUT") or "gpu-acceptance")
    only = args.only.split(",") if args.only else None
    if only:
        for row_id in only:
            _row_by_id(row_id)
    budget = args.budget_s if args.budget_s is not None else (520.0 if mode == "gpu" else 900.0)
    jobs = args.jobs if args.jobs is not None else (2 if mode == "dry" else 1)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gpu-acceptance-") as tmp:
        scratch = args.scratch or Path(tmp)
        report = run_acceptance(mode, out, scratch, only, budget, jobs)
    print((out / "report.md").read_text(encoding="utf-8"), flush=True)
    failed = [r["id"] for r in report["rows"] if r["status"] == "failed"]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
