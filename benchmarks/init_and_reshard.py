"""Layout-independent initialisation against megatron's own, and a resharding load.

Initialisation: a megatron-core GPT of a few hundred million parameters (default: 24
layers, hidden 1024, 16 heads, vocabulary 32768: ~350 M) is built on one CPU rank (a
one-rank gloo group under the engine's CUDA emulation), which is the largest shard any
layout gives a rank, once with megatron's own initialisation (``rng.layout_independent_init
=false``: ``use_cpu_initialization`` draws every full weight, then keeps this rank's slice)
and once with the layout-independent one (tiles drawn from the seed and each tensor's
sharded key). Each variant runs in a fresh child process, alternating, so neither inherits
the other's allocator state; the child reports the build time and its peak resident memory
above what it held before building (``ru_maxrss``). The ratio is layout-independent over
megatron.

Resharding load: the same model family (smaller, ``--reshard-layers``) is trained for two
stepss and saved under TP=2 on two ranks; then loaded under TP=2 (same layout) and under one
process (TP=1, resharding every tensor-parallel weight) and the load times compared.
CPU numbers; on a shared machine run several rounds. It asserts nothing::

    uv run python benchmarks/init_and_reshard.py [--rounds 2] [--layers 24] [--hidden 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def _provider(layers: int, hidden: int, tp: int = 1) -> Any:
    import torch

    from bridge.train.testing import tiny_gpt_provider

    return tiny_gpt_provider(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=16,
        seq_length=16,  # the tiny mock data's sequence length
        vocab_size=32768,
        make_vocab_size_divisible_by=128,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=tp,
    )


def _child_init(variant: str, layers: int, hidden: int) -> dict[str, float]:
    """Build the model once with ``variant``; report seconds and peak RSS growth (MiB)."""
    import resource

    from bridge.config import RNGConfig
    from bridge.train.engine import build_engine
    from bridge.train.engine.initialize import destroy_distributed
    from bridge.train.models.layout_init import layout_independent_seed
    from bridge.train.testing import tiny_dist_config

    provider = _provider(layers, hidden)
    rng = RNGConfig(seed=1234, layout_independent_init=variant == "layout_independent")
    engine = build_engine()
    engine.initialize_distributed(provider, tiny_dist_config(), rng)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    chunks = engine.setup_model(
        provider,
        wrap_with_ddp=False,
        layout_independent_seed=layout_independent_seed(rng, provider),
    )
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    params = sum(p.numel() for chunk in chunks for p in chunk.parameters())
    destroy_distributed()
    return {"seconds": seconds, "peak_mib": peak - before, "params": float(params)}


def _run_child(args: list[str]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    done = subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, text=True, env=env, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _save_and_load(rank: int, world: int, directory: str, layers: int, hidden: int) -> float:
    """Under forked ranks: save (when the directory is empty) or time a load."""
    from bridge.config import CheckpointConfig, LoggerConfig
    from bridge.train import pretrain
    from bridge.train.testing import tiny_config_container, tiny_train_config

    load = Path(directory, "latest_checkpointed_iteration.txt").exists()
    tp = world
    config = tiny_config_container(
        model=_provider(layers, hidden, tp=tp),
        train=tiny_train_config(train_iters=2, global_batch_size=2, micro_batch_size=1),
        logger=LoggerConfig(log_interval=1),
        checkpoint=CheckpointConfig(
            save=None if load else directory,
            save_interval=2,
            load=directory if load else None,
            exit_on_missing_checkpoint=load,
        ),
    )
    start = time.perf_counter()
    pretrain(config)
    return time.perf_counter() - start


def _reshard(layers: int, hidden: int, rounds: int) -> dict[str, float]:
    from core_utils.testing import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        run_distributed(_save_and_load, 2, tmp, layers, hidden, timeout=1800)
        same, resharded = [], []
        for _ in range(rounds):
            same.append(max(run_distributed(_save_and_load, 2, tmp, layers, hidden, timeout=1800)))
            resharded.append(
                run_distributed(_save_and_load, 1, tmp, layers, hidden, timeout=1800)[0]
            )
    return {"same_layout_s": statistics.median(same), "resharded_s": statistics.median(resharded)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--reshard-layers", type=int, default=8)
    parser.add_argument("--skip-reshard", action="store_true")
    parser.add_argument("--child", choices=["megatron", "layout_independent"])
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child_init(args.child, args.layers, args.hidden)))
        return
    results: dict[str, list[dict[str, float]]] = {"megatron": [], "layout_independent": []}
    for _ in range(args.rounds):
        for variant in results:
            shape = ["--layers", str(args.layers), "--hidden", str(args.hidden)]
            results[variant].append(_run_child(["--child", variant, *shape]))
    params = results["megatron"][0]["params"]
    print(f"model: {params / 1e6:.0f} M parameters on one rank, {args.rounds} round(s)")
    med = {
        v: {k: statistics.median(r[k] for r in runs) for k in ("seconds", "peak_mib")}
        for v, runs in results.items()
    }
    for variant, values in med.items():
        print(f"  {variant:>18}: {values['seconds']:7.2f} s, peak +{values['peak_mib']:7.0f} MiB")
    print(
        f"  layout-independent / megatron: time x{med['layout_independent']['seconds'] / med['megatron']['seconds']:.2f}, "
        f"peak memory x{med['layout_independent']['peak_mib'] / max(med['megatron']['peak_mib'], 1):.2f}"
    )
    if not args.skip_reshard:
        reshard = _reshard(args.reshard_layers, args.hidden, args.rounds)
        print(
            f"load: same layout (TP2) {reshard['same_layout_s']:.2f} s, resharded TP2 -> TP1 "
            f"{reshard['resharded_s']:.2f} s, ratio x{reshard['resharded_s'] / reshard['same_layout_s']:.2f} "
            "(whole pretrain call: start-up + load)"
        )


if __name__ == "__main__":
    main()
