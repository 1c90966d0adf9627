"""Checkpoint save/load throughput against plain torch.save/torch.load, and the async stall.

The state is a megatron-core GPT (6 layers, hidden 384, vocabulary 8192, sequence 256:
about 14 M parameters) with its Adam state after one training step: about 165 MB of fp32
tensors, realistic for a CPU run. In one process (a one-rank gloo group) and in rounds that
alternate the variants, so machine noise hits all alike, it measures:

* baseline: ``torch.save`` of exactly the same tensors (model parameters, ``exp_avg``,
  ``exp_avg_sq``) to one file, flushed to disk with ``fsync`` like the checkpoint is, and
  ``torch.load`` of it;
* ``save_checkpoint`` (synchronous, torch_dist via dist_checkpointing, marker + tracker)
  and ``load_checkpoint`` into the same model and optimizer;
* the content hashes' cost (target: at most 5%): saves and loads with and without them,
  interleaved (end to end, as noisy as the saves are), the time the saves with them
  spent hashing, as a fraction of those saves, and a load's verification run alone (it
  normally overlaps the read), as a fraction of the load;
* the training stall of an asynchronous save, as a fraction of the synchronous save's
  time (target: at most 10%): the time ``save_checkpoint`` blocks with ``async_save=True``
  (persistent CPU writer, and a fork per save), plus the time training steps run slower
  while the background writer competes with them for the CPU (training steps run until
  the save is committed, each compared with the median step time without a save pending,
  and the per-iteration ``finalize_async_saves`` polls included).

It prints MB/s for every variant and the ratios; it asserts nothing. Run from the
repository root::

    uv run python benchmarks/checkpoint_io.py [--rounds 3] [--dir /tmp/ckpt-bench]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def _build(directory: Path) -> dict[str, Any]:
    import torch

    from bridge.config import CheckpointConfig, ConfigContainer, LoggerConfig
    from bridge.train import GlobalState
    from bridge.train.engine import build_engine
    from bridge.train.loop.bare_loop import train_steps
    from bridge.train.testing import (
        tiny_dist_config,
        tiny_gpt_provider,
        tiny_mock_dataset_config,
        tiny_mock_iterator,
        tiny_optimizer_config,
        tiny_rng_config,
        tiny_scheduler_config,
        tiny_train_config,
    )

    provider = tiny_gpt_provider(
        num_layers=6,
        hidden_size=384,
        num_attention_heads=6,
        seq_length=256,
        vocab_size=8192,
        make_vocab_size_divisible_by=128,
    )
    cfg = ConfigContainer(
        model=provider,
        optimizer=tiny_optimizer_config(),
        scheduler=tiny_scheduler_config(),
        train=tiny_train_config(train_iters=2000, global_batch_size=2, micro_batch_size=2),
        checkpoint=CheckpointConfig(save=str(directory / "sync"), load=str(directory / "sync")),
        logger=LoggerConfig(),
        dataset=tiny_mock_dataset_config(sequence_length=256),
        rng=tiny_rng_config(),
    )
    engine = build_engine()
    engine.initialize_distributed(provider, tiny_dist_config(), cfg.rng)
    model = engine.setup_model(provider)
    assert cfg.optimizer is not None and cfg.scheduler is not None
    optimizer, scheduler = engine.setup_optimizer(model, cfg.optimizer, cfg.scheduler, cfg.train)
    state = GlobalState(cfg=cfg)
    assert cfg.train is not None
    iterator = tiny_mock_iterator(cfg.train, cfg.dataset)

    def step() -> None:
        train_steps(
            engine,
            model,
            optimizer,
            scheduler,
            iterator,
            train_iters=1,
            global_batch_size=2,
            micro_batch_size=2,
            seq_length=256,
            train_state=state.train_state,
        )

    step()
    tensors: dict[str, torch.Tensor] = {}
    for name, param in model[0].named_parameters():
        tensors[f"model.{name}"] = param.detach()
    # The optimizer's own state, as the checkpoint holds it: the moments of every main
    # parameter of megatron's (chained) optimizer.
    for which, chained in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        inner = chained.optimizer
        mains = [p for group in inner.param_groups for p in group["params"]]
        for index, main in enumerate(mains):
            for key, value in inner.state[main].items():
                if torch.is_tensor(value) and value.dim() > 0:
                    tensors[f"optimizer.{which}.{key}.{index}"] = value
    return {
        "cfg": cfg,
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "state": state,
        "tensors": tensors,
        "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "step": step,
    }


def _timed(fn: Any) -> float:
    """Seconds ``fn()`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _torch_save(tensors: dict[str, Any], path: Path) -> None:
    import torch

    with open(path, "wb") as handle:
        torch.save(tensors, handle)
        handle.flush()
        os.fsync(handle.fileno())


def _torch_load(path: Path) -> None:
    import torch

    torch.load(path, weights_only=True)


def _use(run: dict[str, Any], **checkpoint: Any) -> dict[str, Any]:
    from bridge.train.checkpointing import init_checkpointing_context

    run["state"].cfg.checkpoint = dataclasses.replace(run["state"].cfg.checkpoint, **checkpoint)
    return init_checkpointing_context(run["state"].cfg.checkpoint)


def _save(run: dict[str, Any], context: dict[str, Any]) -> None:
    from bridge.train.checkpointing import save_checkpoint

    save_checkpoint(run["state"], run["model"], run["optimizer"], run["scheduler"], 0.0, context)


def _load(run: dict[str, Any], context: dict[str, Any]) -> None:
    from bridge.train.checkpointing import load_checkpoint

    load_checkpoint(
        run["state"],
        run["model"],
        run["optimizer"],
        run["scheduler"],
        checkpointing_context=context,
    )


def _step_time(run: dict[str, Any], steps: int) -> float:
    """Median seconds of one training step with no save pending."""
    times = [_timed(run["step"]) for _ in range(steps)]
    return statistics.median(times)


def _measure_saves(
    run: dict[str, Any],
    directory: Path,
    rounds: int,
    warmup: int,
    step_time: float | None = None,
    **checkpoint: Any,
) -> tuple[list[float], list[float], list[float]]:
    """Blocking time, time to completion and training slowdown of ``rounds`` saves.

    One checkpointing context and one directory for all of them, with the iteration
    advancing between saves, as in a training run. With ``step_time`` (async saves) the
    training goes on while the save is pending, as in the trainer (a step, then a
    non-blocking finalization poll); the slowdown is the time those steps and polls took
    beyond ``step_time`` per step. Without it the save is waited for at once.
    """
    from bridge.train.checkpointing import finalize_async_saves
    from bridge.train.checkpointing.async_save import pending_async_saves

    shutil.rmtree(directory, ignore_errors=True)
    context = _use(run, save=str(directory), load=str(directory), **checkpoint)
    stalls, totals, slowdowns = [], [], []
    for index in range(warmup + rounds):
        run["state"].train_state.step += 1
        start = time.perf_counter()
        _save(run, context)
        stall = time.perf_counter() - start
        slowdown = 0.0
        if step_time is not None:
            overlapped_start, steps = time.perf_counter(), 0
            while pending_async_saves():
                run["step"]()
                steps += 1
                finalize_async_saves(run["state"].fault_tolerance, blocking=False)
            overlapped = time.perf_counter() - overlapped_start
            slowdown = max(overlapped - steps * step_time, 0.0)
        finalize_async_saves(run["state"].fault_tolerance, blocking=True)
        if index >= warmup:
            stalls.append(stall)
            totals.append(time.perf_counter() - start)
            slowdowns.append(slowdown)
    return stalls, totals, slowdowns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="measurements per variant")
    parser.add_argument(
        "--dir", type=Path, default=None, help="scratch directory (default: a temp dir)"
    )
    args = parser.parse_args()

    import torch

    from bridge.train.checkpointing import finalize_async_saves

    torch.set_num_threads(1)
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="checkpoint-io-"))
    scratch.mkdir(parents=True, exist_ok=True)
    run = _build(scratch)
    megabytes = run["bytes"] / 1e6
    print(f"state: {len(run['tensors'])} tensors, {megabytes:.1f} MB (fp32 parameters + Adam)")

    times: dict[str, list[float]] = {}
    plain = scratch / "plain.pt"
    _torch_save(run["tensors"], plain)  # warm-up
    times["torch.save (+fsync)"] = [
        _timed(functools.partial(_torch_save, run["tensors"], plain)) for _ in range(args.rounds)
    ]
    times["torch.load"] = [
        _timed(functools.partial(_torch_load, plain)) for _ in range(args.rounds)
    ]
    times["save_checkpoint"], _, _ = _measure_saves(run, scratch / "sync", args.rounds, 1)
    context = _use(run, load=str(scratch / "sync"))
    _load(run, context)  # warm-up
    times["load_checkpoint"] = [
        _timed(functools.partial(_load, run, context)) for _ in range(args.rounds)
    ]
    # The checksums' cost: the same save and load with them switched off, interleaved.
    import bridge.train.checkpointing.load as load_module
    import bridge.train.checkpointing.save as save_module

    real_checksums, real_damage = save_module.checksum_files, load_module.checkpoint_problems
    hashing: list[float] = []  # time inside checksum_files, per save with checksums
    verifying: list[float] = []  # a load's verification run alone, per load with checksums

    def timed_checksums(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return real_checksums(*args, **kwargs)
        finally:
            hashing.append(time.perf_counter() - start)

    def unchecked(on: bool) -> None:
        save_module.checksum_files = timed_checksums if on else (lambda *a, **k: {})
        load_module.checkpoint_problems = real_damage if on else (lambda *a, **k: None)

    logging_level = logging.getLogger("bridge.train.checkpointing.load").level
    logging.getLogger("bridge.train.checkpointing.load").setLevel(logging.ERROR)
    pairs: dict[str, list[float]] = {k: [] for k in ("save on", "save off", "load on", "load off")}
    directory = scratch / "checksums"
    shutil.rmtree(directory, ignore_errors=True)
    context = _use(run, save=str(directory), load=str(directory))
    for index in range(args.rounds + 1):
        for on in (True, False):
            unchecked(on)
            run["state"].train_state.step += 1
            save = _timed(functools.partial(_save, run, context))
            load = _timed(functools.partial(_load, run, context))
            if on:
                # The same verification the load ran beside its read, now alone: what it
                # would add if none of it overlapped the read.
                loaded = context["loaded_checkpoint"]
                verifying.append(_timed(functools.partial(real_damage, loaded)))
            if index:  # the first round warms up
                pairs[f"save {'on' if on else 'off'}"].append(save)
                pairs[f"load {'on' if on else 'off'}"].append(load)
            elif on:
                hashing.clear()
                verifying.clear()
    save_module.checksum_files, load_module.checkpoint_problems = real_checksums, real_damage
    logging.getLogger("bridge.train.checkpointing.load").setLevel(logging_level)
    times["save_checkpoint without checksums"] = pairs["save off"]
    times["save_checkpoint with checksums"] = pairs["save on"]
    times["load_checkpoint without checksums"] = pairs["load off"]
    times["load_checkpoint with checksums"] = pairs["load on"]
    times["hashing inside save_checkpoint"] = hashing
    times["load verification alone"] = verifying
    async_variants = {
        "persistent writer": {"use_persistent_ckpt_worker": True},
        "fork per save": {"use_persistent_ckpt_worker": False},
        "persistent + constant structure": {
            "use_persistent_ckpt_worker": True,
            "ckpt_assume_constant_structure": True,
        },
    }
    step_time = _step_time(run, 10)
    times["training step (no save pending)"] = [step_time]
    for label, settings in async_variants.items():
        stalls, totals, slowdowns = _measure_saves(
            run,
            scratch / label.replace(" ", "_"),
            args.rounds,
            2,
            step_time=step_time,
            async_save=True,
            **settings,
        )
        times[f"async blocking ({label})"] = stalls
        times[f"async slower steps ({label})"] = slowdowns
        times[f"async stall ({label})"] = [a + b for a, b in zip(stalls, slowdowns, strict=True)]
        times[f"async to completion ({label})"] = totals
    finalize_async_saves(run["state"].fault_tolerance, blocking=True, terminate=True)

    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"\nmedian of {args.rounds} measurements (after warm-up)")
    print(f"{'variant':48s} {'seconds':>9s} {'MB/s':>9s}")
    for key, value in median.items():
        # A transfer rate only for rows that move the whole state.
        moves_state = key.startswith(("torch.", "save_", "load_", "async to"))
        rate = f"{megabytes / value:9.1f}" if moves_state and value > 0 else ""
        print(f"{key:48s} {value:9.3f} {rate}")
    print("\nratios")
    save_ratio = median["save_checkpoint"] / median["torch.save (+fsync)"]
    load_ratio = median["load_checkpoint"] / median["torch.load"]
    print(f"save_checkpoint / torch.save time: {save_ratio:.2f}x")
    print(f"load_checkpoint / torch.load time: {load_ratio:.2f}x")
    for what in ("save", "load"):
        with_sums = times[f"{what}_checkpoint with checksums"]
        without = times[f"{what}_checkpoint without checksums"]
        # Paired by round (each round runs both back to back), so drift over the run cancels.
        extra = statistics.median(a - b for a, b in zip(with_sums, without, strict=True))
        fraction = extra / statistics.median(with_sums)
        verdict = "meets" if fraction <= 0.05 else "misses"
        print(
            f"checksum cost / {what}_checkpoint: {fraction:.1%} ({verdict} the 5% target; "
            "with minus without in the same round, end to end, median over rounds)"
        )
    for name, part, whole, how in (
        (
            "hashing / save_checkpoint",
            "hashing inside save_checkpoint",
            "save_checkpoint with checksums",
            "the time spent in checksum_files during the same saves",
        ),
        (
            "verification alone / load_checkpoint",
            "load verification alone",
            "load_checkpoint with checksums",
            "an upper bound: the loads overlap it with their read",
        ),
    ):
        fraction = median[part] / median[whole]
        verdict = "meets" if fraction <= 0.05 else "misses"
        print(f"{name}: {fraction:.1%} ({verdict} the 5% target; {how})")
    for label in async_variants:
        fraction = median[f"async stall ({label})"] / median["save_checkpoint"]
        verdict = "meets" if fraction <= 0.10 else "misses"
        print(
            f"async stall / sync save ({label}): {fraction:.1%} ({verdict} the 10% target; "
            "blocking + slower steps)"
        )
    if args.dir is None:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":  # dist_checkpointing may start helper processes
    main()
