"""The steps of the GPU acceptance run that import torch, one per process.

``benchmarks/gpu_acceptance.py`` starts each step as its own process (a crash, an
out-of-memory error or a hang ends that step only) and reads the JSON it writes::

    python benchmarks/gpu/steps.py STEP --args '{"...": ...}' --result FILE

Steps (each a function below, keyword arguments from ``--args``):

``env``
    Versions (Python, torch, CUDA, driver, GPU, megatron-core, this project's
    distributions), where ``bridge.train`` was imported from, and whether the installed
    versions satisfy every requirement of the project's distributions.
``gemm``
    The chip's bf16 matrix-multiply rate (8192^3 by default): the peak MFU is taken against.
``probe``
    The largest micro batch whose training step fits (the bare loop below, ascending sizes
    until out of memory).
``bare``
    A bare megatron-core loop: ``GPTModel`` from the provider, megatron-core's
    ``DistributedDataParallel``, ``get_megatron_optimizer`` (distributed optimizer, fp32 main
    params), ``OptimizerParamScheduler``, ``get_forward_backward_func`` and
    ``MockGPTDataset`` through a ``DataLoader``: what a megatron-core user writes by hand.
``trainer``
    ``bridge.train.pretrain`` of a recipe plus overrides, with a callback that times every
    iteration (the device is synchronised at each iteration's start and end, as in the
    bare loop) and the peak memory.
``checkpoint``
    Two ``pretrain`` runs: a synchronous save, then a run that loads it and saves
    asynchronously (megatron-core's persistent worker) while training goes on.
``finetune``
    Packed SFT, or LoRA on an SFT base, through ``pretrain`` and the built-in recipes.
``host_syncs``
    ``benchmarks/host_syncs.py``'s count of host-value requests per iteration, and on CUDA
    the synchronising CUDA calls torch's sync debug mode reports, over the same windows.

Only public entry points are used: ``bridge.config.load_config``, the built-in recipes,
``bridge.train.pretrain`` and ``bridge.train.Callback``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import logging
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "STEPS",
    "bare",
    "checkpoint",
    "env",
    "finetune",
    "gemm",
    "generate",
    "host_syncs",
    "main",
    "probe",
    "read_metrics",
    "trainer",
]

_BENCHMARKS = Path(__file__).resolve().parents[1]


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _now() -> float:
    _sync()
    return time.perf_counter()


def _peak_memory_gb() -> dict[str, float] | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return {
        "peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9,
        "peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9,
        "device_total_gb": torch.cuda.get_device_properties(0).total_memory / 1e9,
    }


def _config(recipe: str, overrides: list[str]) -> Any:
    """The recipe (a built-in name or a YAML path) with ``overrides``, as ``bridge-train``."""
    from bridge.config import load_config

    path = Path(recipe)
    if not path.suffix:
        from bridge.train.recipes import recipe_path

        path = recipe_path(recipe)
    return load_config(path, overrides)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``--metrics-file`` (JSON lines); empty if it was never written."""
    file = Path(path)
    if not file.exists():
        return []
    return [json.loads(line) for line in file.read_text(encoding="utf-8").splitlines() if line]


# -- env -------------------------------------------------------------------------------------


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _unmet_requirements(dists: list[str]) -> list[str]:
    """Requirements of ``dists`` the installed versions do not satisfy (extras skipped)."""
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.requirements import Requirement

    unmet = []
    for dist in dists:
        try:
            lines = requires(dist) or []
        except PackageNotFoundError:
            unmet.append(f"{dist}: not installed")
            continue
        for line in lines:
            requirement = Requirement(line)
            if requirement.marker is not None and "extra" in str(requirement.marker):
                continue
            installed = _dist_version(requirement.name)
            if installed is None:
                unmet.append(f"{dist} needs {requirement}: not installed")
            elif not requirement.specifier.contains(installed, prereleases=True):
                unmet.append(f"{dist} needs {requirement}: {installed} installed")
    return unmet


def env() -> dict[str, Any]:
    """Versions and the machine's GPU; requirement check of the installed distributions."""
    import importlib.util
    import platform

    import torch

    project = [
        "core-utils",
        "bridge-config",
        "bridge-logging",
        "bridge-resiliency",
        "bridge-mimo",
        "bridge-train",
    ]
    others = ["megatron-core", "numpy", "omegaconf", "pyyaml", "tensorboard", "transformer-engine"]
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "versions": {name: _dist_version(name) for name in project + others},
        "bridge_train_from": None,
        "unmet_requirements": _unmet_requirements([*project, "megatron-core"]),
        "transformer_engine": importlib.util.find_spec("transformer_engine") is not None,
    }
    spec = importlib.util.find_spec("bridge.train")
    if spec is not None and spec.submodule_search_locations:
        info["bridge_train_from"] = next(iter(spec.submodule_search_locations))
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=torch.cuda.get_device_name(0),
            gpu_memory_gb=round(props.total_memory / 1e9, 1),
            compute_capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            cudnn=torch.backends.cudnn.version(),
            nccl=str(torch.cuda.nccl.version()),
        )
        smi = shutil.which("nvidia-smi")
        if smi is not None:
            query = subprocess.run(
                [smi, "--query-gpu=driver_version,name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                check=False,
                timeout=30,
            )
            if query.returncode == 0 and query.stdout.strip():
                info["driver"] = query.stdout.strip().splitlines()[0].split(",")[0].strip()
    return info


# -- gemm ------------------------------------------------------------------------------------


def gemm(size: int = 8192, warmup: int = 3, repeats: int = 10) -> dict[str, Any]:
    """bf16 ``size``^3 matrix products on random data: TFLOP/s (mean and best of ``repeats``)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("the bf16 GEMM peak needs CUDA")
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(warmup):
        torch.matmul(a, b)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.matmul(a, b)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    flops = 2.0 * size**3
    return {
        "size": size,
        "tflops_mean": flops / statistics.mean(times) / 1e12,
        "tflops_best": flops / min(times) / 1e12,
    }


# -- the bare megatron-core loop -------------------------------------------------------------


class _BareRun:
    """Model, optimizer and data of the bare loop, built once (``probe`` reuses them)."""

    def __init__(self, recipe: str, overrides: list[str]) -> None:
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.transformer.module import Float16Module

        from bridge.train.engine.megatron import use_sync_free_grad_norm

        self.exit_stack = contextlib.ExitStack()
        if not torch.cuda.is_available():
            # megatron-core's DDP and optimizers assume CUDA; on CPU they run under the
            # project's emulation, as the trainer's engine does (docs/engines.md).
            from core_utils import cuda_emulation

            self.exit_stack.enter_context(cuda_emulation())
        else:
            torch.cuda.set_device(0)
        cfg = _config(recipe, overrides)
        self.cfg = cfg
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            dist.init_process_group(backend, rank=0, world_size=1)
        parallel_state.initialize_model_parallel()
        torch.manual_seed(cfg.rng.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.rng.seed)
        provider = cfg.model
        if provider.vocab_size is None:
            provider.vocab_size = cfg.tokenizer.vocab_size
        self.provider = provider
        model = provider.provide()
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        if provider.bf16 or provider.fp16:
            model = Float16Module(provider, model)
        # The trainer's own sections, so that both sides train the same way: megatron's
        # OptimizerConfig (the recipe's optimizer section is one), its DDP fields, and the
        # schedule the validated config derives.
        cfg.validate(1)
        names = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
        ddp_config = DistributedDataParallelConfig(
            **{
                f.name: getattr(cfg.ddp, f.name)
                for f in dataclasses.fields(cfg.ddp)
                if f.name in names
            }
        )
        self.model = DistributedDataParallel(config=provider, ddp_config=ddp_config, module=model)
        provider.no_sync_func = self.model.no_sync
        provider.finalize_model_grads_func = finalize_model_grads
        opt = cfg.optimizer
        # The grad norm the trainer's engine installs (no host sync per parameter), so the
        # step-time ratio compares the framework, not two norm implementations.
        use_sync_free_grad_norm()
        self.optimizer = get_megatron_optimizer(opt, [self.model])
        self.global_batch = cfg.train.global_batch_size
        sched = cfg.scheduler
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=sched.lr_warmup_init,
            max_lr=opt.lr,
            min_lr=opt.min_lr,
            lr_warmup_steps=sched.lr_warmup_steps,
            lr_decay_steps=sched.lr_decay_steps,
            lr_decay_style=sched.lr_decay_style,
            start_wd=opt.weight_decay
            if sched.start_weight_decay is None
            else sched.start_weight_decay,
            end_wd=opt.weight_decay if sched.end_weight_decay is None else sched.end_weight_decay,
            wd_incr_steps=sched.wd_incr_steps,
            wd_incr_style=sched.weight_decay_incr_style,
        )
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

    def batches(self, micro_batch: int, count: int) -> Iterator[dict[str, Any]]:
        """``count`` micro-batches of megatron-core's mock GPT data, moved to the device."""
        import torch
        from megatron.core.datasets.blended_megatron_dataset_builder import (
            BlendedMegatronDatasetBuilder,
        )
        from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
        from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

        config = GPTDatasetConfig(
            random_seed=self.cfg.dataset.random_seed,
            sequence_length=self.provider.seq_length,
            blend=None,
            split="1,0,0",
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            create_attention_mask=False,
            tokenizer=NullTokenizer(self.provider.vocab_size),
        )
        train, _, _ = BlendedMegatronDatasetBuilder(
            MockGPTDataset, [micro_batch * count, 0, 0], lambda: True, config
        ).build()
        loader = torch.utils.data.DataLoader(
            train, batch_size=micro_batch, drop_last=True, pin_memory=self.device.type == "cuda"
        )
        for batch in loader:
            yield {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def step(self, micro_batch: int, data: Iterator[dict[str, Any]]) -> Any:
        """One training iteration (one micro-batch per step); returns the loss (on device)."""
        import torch
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Any, model: Any) -> Any:
            batch = next(data_iterator)
            output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
            mask = batch["loss_mask"].float()

            def loss_func(per_token: torch.Tensor) -> Any:
                loss = (per_token.float() * mask).sum()
                tokens = mask.sum().to(torch.int)
                return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float()])}

            return output, loss_func

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data,
            model=[self.model],
            num_microbatches=self.global_batch // micro_batch,
            seq_length=self.provider.seq_length,
            micro_batch_size=micro_batch,
            forward_only=False,
        )
        self.optimizer.step()
        self.scheduler.step(increment=self.global_batch)
        total = torch.stack([r["lm loss"] for r in reports]).sum(dim=0)
        return total[0] / total[1]

    def close(self) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.exit_stack.close()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def bare(recipe: str, overrides: list[str], warmup: int) -> dict[str, Any]:
    """Train ``train.train_iters`` steps with the bare loop; time the steps after ``warmup``."""
    import torch

    run = _BareRun(recipe, overrides)
    micro = run.cfg.train.micro_batch_size
    steps = run.cfg.train.train_iters
    data = run.batches(micro, steps * (run.global_batch // micro))
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    losses = []
    starts, ends = [], []
    for iteration in range(1, steps + 1):
        starts.append(_now())
        loss = run.step(micro, data)
        losses.append(loss.detach())
        if iteration % 10 == 0:
            print(f"bare iteration {iteration}/{steps} | lm loss {loss.item():.6E}", flush=True)
        ends.append(_now())
    result = {
        "step_seconds": (ends[-1] - starts[warmup]) / (steps - warmup),
        "losses": [float(v) for v in torch.stack(losses).float().cpu()],
        "memory": _peak_memory_gb(),
        "micro_batch_size": micro,
        "global_batch_size": run.global_batch,
        "parameters": sum(p.numel() for p in run.model.parameters()),
    }
    run.close()
    return result


def probe(
    recipe: str, overrides: list[str], candidates: list[int], memory_fraction: float
) -> dict[str, Any]:
    """The largest micro batch of ``candidates`` whose steps fit the GPU.

    The bare loop's model and optimizer are built once; for each candidate (ascending) two
    steps run with one micro-batch per step. A candidate fits when it raised no
    out-of-memory error and its peak reserved memory is at most ``memory_fraction`` of
    the device (the trainer holds a little more than the bare loop). The search stops at
    the first candidate that does not fit.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("the micro-batch probe needs CUDA")
    run = _BareRun(recipe, overrides)
    total = torch.cuda.get_device_properties(0).total_memory
    tried: list[dict[str, Any]] = []
    best = None
    for micro in sorted(candidates):
        run.global_batch = micro
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        entry: dict[str, Any] = {"micro_batch_size": micro}
        try:
            data = run.batches(micro, 2)
            for _ in range(2):
                run.step(micro, data)
            _sync()
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not isinstance(exc, torch.OutOfMemoryError) and "out of memory" not in str(exc):
                raise
            entry["fits"] = False
            entry["error"] = str(exc).splitlines()[0][:300]
            tried.append(entry)
            break
        entry["peak_reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
        entry["fits"] = torch.cuda.max_memory_reserved() <= memory_fraction * total
        tried.append(entry)
        if not entry["fits"]:
            break
        best = micro
    return {"micro_batch_size": best, "tried": tried, "device_total_gb": total / 1e9}


# -- the trainer -----------------------------------------------------------------------------


def _callback_base() -> type:
    from bridge.train import Callback

    return Callback


class _LogCapture(logging.Handler):
    """Keeps the messages of bridge's loggers (the trainer reports save/load times there)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self.messages.append(record.getMessage())


def _make_clock() -> Any:
    """A ``bridge.train.Callback`` that timestamps the loop's hooks (device synchronised)."""

    class Clock(_callback_base()):  # type: ignore[misc]
        def __init__(self) -> None:
            self.created = time.perf_counter()
            self.train_start: float | None = None
            self.train_end: float | None = None
            self.starts: list[float] = []
            self.ends: list[float] = []
            self.saves: list[tuple[int, float]] = []  # (steps completed, time) per commit
            self.on_start: Callable[[], None] | None = None

        def on_train_start(self, context: Any) -> None:
            self.train_start = _now()
            if self.on_start is not None:
                self.on_start()

        def on_step_start(self, context: Any) -> None:
            self.starts.append(_now())

        def on_step_end(self, context: Any) -> None:
            self.ends.append(_now())

        def on_save(self, context: Any) -> None:
            self.saves.append((len(self.ends), _now()))

        def on_train_end(self, context: Any) -> None:
            self.train_end = _now()

        def durations(self) -> list[float]:
            return [end - start for start, end in zip(self.starts, self.ends, strict=False)]

    return Clock()


def _pretrain(recipe: str, overrides: list[str], metrics_file: Path, clock: Any) -> int:
    from bridge.train import pretrain

    cfg = _config(recipe, overrides)
    handler = _LogCapture()
    logging.getLogger("bridge").addHandler(handler)
    clock.log = handler.messages
    try:
        return int(pretrain(cfg, metrics_file=metrics_file, callbacks=[clock]))
    finally:
        logging.getLogger("bridge").removeHandler(handler)


def _losses(records: list[dict[str, Any]]) -> list[float]:
    return [float(r["lm loss"]) for r in records if "lm loss" in r]


def trainer(recipe: str, overrides: list[str], warmup: int, metrics_file: str) -> dict[str, Any]:
    """``pretrain`` with a timing callback; times the iterations after ``warmup``."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    clock = _make_clock()
    code = _pretrain(recipe, overrides, Path(metrics_file), clock)
    records = read_metrics(metrics_file)
    steps = len(clock.ends)
    result: dict[str, Any] = {
        "exit_code": code,
        "steps": steps,
        "losses": _losses(records),
        "loss_steps": [int(r["step"]) for r in records if "lm loss" in r and "step" in r],
        "memory": _peak_memory_gb(),
        "reported_tflops": [
            r["throughput/tflops/device"] for r in records if "throughput/tflops/device" in r
        ],
        "reported_tokens_per_s": [
            r["throughput/tokens_per_sec"] for r in records if "throughput/tokens_per_sec" in r
        ],
    }
    if steps > warmup:
        result["step_seconds"] = (clock.ends[-1] - clock.starts[warmup]) / (steps - warmup)
    return result


# -- checkpoints -----------------------------------------------------------------------------


def _intervals(clock: Any) -> list[float]:
    """Seconds between consecutive iteration starts (the last iteration: start to end)."""
    starts = clock.starts
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    if clock.ends:
        gaps.append(clock.ends[-1] - starts[-1])
    return gaps


def _size_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _seconds_in_log(messages: list[str], pattern: str) -> float | None:
    for message in messages:
        match = re.search(pattern, message)
        if match:
            return float(match.group(1))
    return None


def checkpoint(
    recipe: str,
    overrides: list[str],
    scratch: str,
    interval: int,
    metrics_file: str,
    budget_s: float | None = None,
) -> dict[str, Any]:
    """Synchronous save, load, and asynchronous saves of the same model, timed.

    Run A trains ``interval`` iterations and saves synchronously at the last one. Run B
    loads it (A's checkpoint is deleted once loaded, to bound the disk), trains
    ``2 * interval`` more iterations with ``checkpoint.async_save`` and megatron-core's
    persistent worker, saving at iteration ``2 * interval`` (training goes on while it is
    written) and ``3 * interval`` (the run's end waits for it). Iteration times come from
    a callback that synchronises the device at each iteration's start and end; the time a
    save blocks training is its iteration's time minus the median iteration time of run A.

    When run A's save shows that two more saves and a load would not fit ``budget_s``, run
    B trains ``interval`` iterations and saves once, at its end: the blocking part of that
    save is then not told apart from its write (``async_save_blocking_seconds`` is None).
    """
    started = time.monotonic()
    root = Path(scratch)
    dir_a, dir_b = root / "ckpt_sync", root / "ckpt_async"
    for directory in (dir_a, dir_b):
        shutil.rmtree(directory, ignore_errors=True)
    common = [*overrides, f"checkpoint.save_interval={interval}"]

    clock_a = _make_clock()
    code_a = _pretrain(
        recipe,
        [*common, f"train.train_iters={interval}", f"checkpoint.save={dir_a}"],
        Path(metrics_file + ".sync"),
        clock_a,
    )
    if code_a != 0:
        raise RuntimeError(f"the synchronous-save run exited with {code_a}")
    # Where the checkpointer's hooks run relative to this callback's is the loop's business,
    # so a save is timed by the intervals between iteration starts (which contain it either
    # way) against the median interval of iterations without one; a save after the last
    # iteration by the time from that iteration's start to the commit.
    step = statistics.median(_intervals(clock_a)[1:] or _intervals(clock_a))
    duration = statistics.median(clock_a.durations())
    size = _size_bytes(dir_a)
    if not clock_a.saves:
        raise RuntimeError("the synchronous save was never committed (no on_save)")
    # Differences of wall times: clamped at 0, where a toy-sized save is below the noise.
    sync_blocked = max(clock_a.saves[-1][1] - clock_a.starts[-1] - duration, 0.0)

    # Run B costs about run A again (set-up, load instead of the save) plus its saves.
    elapsed_a = time.monotonic() - started
    projected = 2 * elapsed_a + 2 * sync_blocked + 30
    overlap = budget_s is None or projected < budget_s - elapsed_a
    clock_b = _make_clock()
    clock_b.on_start = lambda: shutil.rmtree(dir_a, ignore_errors=True)
    code_b = _pretrain(
        recipe,
        [
            *common,
            f"train.train_iters={(3 if overlap else 2) * interval}",
            f"checkpoint.load={dir_a}",
            f"checkpoint.save={dir_b}",
            "checkpoint.async_save=true",
            "checkpoint.use_persistent_ckpt_worker=true",
        ],
        Path(metrics_file + ".async"),
        clock_b,
    )
    if code_b != 0:
        raise RuntimeError(f"the load + asynchronous-save run exited with {code_b}")
    intervals_b = _intervals(clock_b)
    first_save = interval - 1  # index of iteration 2 * interval in run B (resumed at interval)
    commit_step, commit_time = clock_b.saves[0] if clock_b.saves else (None, None)
    async_blocked: float | None = None
    overlapped: list[float] = []
    if overlap:
        async_blocked = max(intervals_b[first_save] - step, 0.0)
        overlapped = intervals_b[first_save + 1 : commit_step] if commit_step else []
    slowdown = sum(max(d - step, 0.0) for d in overlapped)
    write_seconds = None
    if commit_time is not None:
        write_seconds = commit_time - (clock_b.starts[first_save] + duration)
    end_wait = None
    if clock_b.saves and clock_b.ends:
        end_wait = clock_b.saves[-1][1] - clock_b.ends[-1]
    load_logged = _seconds_in_log(clock_b.log, r"loaded .* checkpoint .*\(.*; ([\d.]+) s\)")
    sync_logged = _seconds_in_log(clock_a.log, r"saved checkpoint .*\(([\d.]+) s\)")
    return {
        "checkpoint_bytes": size,
        "median_step_seconds": step,
        "median_step_compute_seconds": duration,
        "sync_save_blocked_seconds": sync_blocked,
        "sync_save_logged_seconds": sync_logged,
        "load_logged_seconds": load_logged,
        "async_save_blocking_seconds": async_blocked,
        "async_slower_steps_seconds": slowdown,
        "async_steps_overlapped": len(overlapped),
        "async_write_seconds": write_seconds,
        "async_commits": len(clock_b.saves),
        "async_saves_planned": 2 if overlap else 1,
        "async_overlap_measured": overlap,
        "async_end_wait_seconds": end_wait,
        "memory": _peak_memory_gb(),
    }


# -- finetuning ------------------------------------------------------------------------------


def finetune(
    recipe: str, overrides: list[str], metrics_file: str, base: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``pretrain`` of a finetuning recipe; with ``base`` first trains the base it loads.

    Args:
        recipe: ``sft`` (packed SFT through the overrides) or ``sft_lora``.
        overrides: Overrides of ``recipe``.
        metrics_file: Where the run writes its metrics.
        base: ``{"recipe": ..., "overrides": [...]}`` of a run whose checkpoint the main run
            names in ``checkpoint.pretrained_checkpoint`` (LoRA needs a trained base).
    """
    result: dict[str, Any] = {}
    if base is not None:
        base_clock = _make_clock()
        code = _pretrain(
            base["recipe"], base["overrides"], Path(metrics_file + ".base"), base_clock
        )
        result["base_exit_code"] = code
        if code != 0:
            raise RuntimeError(f"the base run exited with {code}")
        result["base_validation_loss"] = _last_validation_loss(read_metrics(metrics_file + ".base"))
    clock = _make_clock()
    code = _pretrain(recipe, overrides, Path(metrics_file), clock)
    records = read_metrics(metrics_file)
    durations = clock.durations()
    result.update(
        exit_code=code,
        steps=len(durations),
        losses=_losses(records),
        step_seconds=statistics.median(durations[1:]) if len(durations) > 1 else None,
        reported_tokens_per_s=[
            r["throughput/tokens_per_sec"] for r in records if "throughput/tokens_per_sec" in r
        ],
        memory=_peak_memory_gb(),
        validation_loss=_last_validation_loss(records),
    )
    return result


def _last_validation_loss(records: list[dict[str, Any]]) -> float | None:
    values = [float(r["lm loss validation"]) for r in records if "lm loss validation" in r]
    return values[-1] if values else None


# -- host syncs ------------------------------------------------------------------------------

_CUDA_SYNC_WARNING = "called a synchronizing CUDA operation"


def _host_syncs_script() -> Any:
    """``benchmarks/host_syncs.py`` (the windows and the call-site naming are its own)."""
    if str(_BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(_BENCHMARKS))
    import host_syncs  # type: ignore[import-not-found]

    return host_syncs


# Frames that are never "who asked": torch itself, the warnings machinery, and the
# counting wrappers (host_syncs.py's TorchFunctionMode runs every torch call, so a warning
# raised from C++ is otherwise filed under its ``return func(...)`` line).
_NOT_A_CALLER = ("/torch/", "/warnings.py", "host_syncs.py", "gpu/steps.py")


@contextlib.contextmanager
def _counting_sync_warnings(sites: dict[str, int]) -> Iterator[None]:
    """Counts torch's synchronising-CUDA-call warnings by the caller that made them.

    The warning's own location is the innermost Python frame, which is whatever wrapper
    called into torch; the caller is found on the stack at the moment it is shown instead.
    """
    describe_caller = _host_syncs_script().describe_caller
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def count(
            message: Warning | str,
            category: type[Warning],
            filename: str,
            lineno: int,
            file: Any = None,
            line: str | None = None,
        ) -> None:
            if _CUDA_SYNC_WARNING in str(message):
                site = describe_caller(traceback.extract_stack()[:-1], _NOT_A_CALLER, depth=2)
                sites[site] = sites.get(site, 0) + 1
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = count
        yield


def host_syncs(overrides: list[str], log_interval: int) -> dict[str, Any]:
    """Host synchronisations per iteration of ``pretrain`` (``benchmarks/host_syncs.py``).

    The windows are ``host_syncs.py``'s: an iteration without a log line and one with it,
    each from its first micro-batch fetch to the next iteration's. In each window the
    TorchFunctionMode of ``host_syncs.py`` counts the host-value requests by call site; on
    CUDA, torch's sync debug mode (``torch.cuda.set_sync_debug_mode("warn")``) also reports
    every synchronising CUDA call, which is counted too.
    """
    import torch

    iteration_windows: Any = _host_syncs_script()._IterationWindows

    from bridge.train import forward_step, pretrain

    cuda = torch.cuda.is_available()

    class Windows(iteration_windows):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self.cuda_counts: dict[str, dict[str, int]] = {}
            self._capture: Any = None

        def _iteration_starts(self, completed: int) -> None:
            closing = self.open[0] if self.open is not None else None
            super()._iteration_starts(completed)
            if closing is not None and self._capture is not None:
                torch.cuda.set_sync_debug_mode(0)
                self._capture.__exit__(None, None, None)
                self._capture = None
            if cuda and self.open is not None:
                sites: dict[str, int] = {}
                self.cuda_counts[self.open[0]] = sites
                self._capture = _counting_sync_warnings(sites)
                self._capture.__enter__()
                torch.cuda.set_sync_debug_mode(1)

    windows = {
        "iteration without a log line": 2 * log_interval + 2,
        "iteration with a log line": 3 * log_interval - 1,
    }
    steps = 3 * log_interval + 2
    cfg = _config(
        "tiny_gpt",
        [
            *overrides,
            f"train.train_iters={steps}",
            f"logger.log_interval={log_interval}",
            "train.eval_iters=0",
        ],
    )
    counter = Windows(cfg.train.global_batch_size // cfg.train.micro_batch_size, windows)
    import io
    import tempfile

    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        code = pretrain(cfg, counter.wrap(forward_step), metrics_file=Path(tmp) / "m.jsonl")
    if code != 0:
        raise RuntimeError(f"pretrain exited with {code}")
    result: dict[str, Any] = {"windows": {}}
    for label in windows:
        sites = dict(counter.counts.get(label, {}))
        entry: dict[str, Any] = {"host_value_requests": sum(sites.values()), "sites": sites}
        if cuda:
            cuda_sites = counter.cuda_counts.get(label, {})
            entry["cuda_synchronizing_calls"] = sum(cuda_sites.values())
            entry["cuda_sites"] = cuda_sites
        result["windows"][label] = entry
    return result


# -- generation ------------------------------------------------------------------------------


def generate(
    checkpoint: str, prompts: list[str], new_tokens: list[int], rounds: int = 3
) -> dict[str, Any]:
    """Decode rate of ``bridge-generate``'s machinery, timed inside one process.

    ``load_generation_model`` + ``TextGenerator`` (what the command runs), one warm-up
    generation, then ``rounds`` alternating greedy generations of each length in
    ``new_tokens`` (past the end-of-document token, so every prompt gets exactly that
    many). The decode rate is the difference of the median times of the longest and the
    shortest over the difference of their new tokens: the prompt's prefill cancels out.
    Timing two whole processes instead (the first GPU run) left the start-up's noise in it.
    """
    from bridge.train.generate import SamplingOptions, load_generation_model

    loaded = load_generation_model(checkpoint)
    try:
        generator = loaded.generator(max_batch_size=len(prompts))
        generator.generate(prompts, SamplingOptions(max(new_tokens), stop_at_eod=False))
        seconds: dict[int, list[float]] = {n: [] for n in new_tokens}
        tokens: dict[int, int] = {}
        for _ in range(rounds):
            for n in new_tokens:
                start = _now()
                done = generator.generate(prompts, SamplingOptions(n, stop_at_eod=False))
                seconds[n].append(_now() - start)
                tokens[n] = sum(len(c.token_ids) for c in done)
    finally:
        loaded.close()
    median = {n: statistics.median(v) for n, v in seconds.items()}
    short, long = min(new_tokens), max(new_tokens)
    rate = None
    if median[long] > median[short]:
        rate = (tokens[long] - tokens[short]) / (median[long] - median[short])
    return {
        "tokens": tokens,
        "seconds": seconds,
        "median_seconds": median,
        "decode_tokens_per_s": rate,
        "decode_step_ms": None if rate is None else 1e3 * len(prompts) / rate,
    }


STEPS: dict[str, Callable[..., dict[str, Any]]] = {
    "env": env,
    "gemm": gemm,
    "probe": probe,
    "bare": bare,
    "trainer": trainer,
    "checkpoint": checkpoint,
    "finetune": finetune,
    "host_syncs": host_syncs,
    "generate": generate,
}


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> None:
    """Run one step and write its JSON result (exit code 1 and a traceback on failure)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=sorted(STEPS))
    parser.add_argument("--args", default="{}", help="keyword arguments as a JSON object")
    parser.add_argument("--result", required=True, type=Path, help="JSON file to write")
    args = parser.parse_args(argv)
    try:
        result = STEPS[args.step](**json.loads(args.args))
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        _exit_now(1)  # no teardown of half-built distributed state
    tmp = args.result.with_suffix(".tmp")
    tmp.write_text(json.dumps(_jsonable(result), indent=1), encoding="utf-8")
    tmp.replace(args.result)
    sys.stdout.flush()
    sys.stderr.flush()
    # dist_checkpointing's worker processes and the DataLoader can hold the exit up.
    _exit_now(0)


def _exit_now(code: int) -> None:
    """Leave at once, and take this step's helper processes along: ``os._exit`` skips the
    finalizers that would stop them (dist_checkpointing's Manager server, an async
    checkpoint writer, DataLoader workers), which would otherwise outlive the run."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()
    os._exit(code)


if __name__ == "__main__":  # dist_checkpointing may start helper processes
    main()
