"""Finetuning speed: packed vs unpacked SFT, and LoRA vs full finetuning.

1. Packing: the same SFT examples of varied lengths (prompts and answers of 2-60 bytes,
   byte-level tokens) trained unpacked (one example per ``seq_length`` sample, padded)
   and packed (several examples per sample, block-diagonal attention). Reported: useful
   (non-padding) tokens per second of each, and their ratio (goal: packed >= 1.5x).
2. LoRA vs full finetuning of the same model: step time ratio, and optimizer-state memory
   ratio (bytes of Adam state the optimizer holds after a step).

Both sides of each comparison run in this process, alternating (A B A B), on one rank;
medians are compared. Nothing is asserted.

    uv run python benchmarks/finetune_packing.py [--steps 20] [--rounds 2]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def _write_examples(root: Path, count: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "kappa"]
    lines = []
    for _ in range(count):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 8)))
        answer = " ".join(rng.choice(words) for _ in range(rng.randint(1, 6)))
        lines.append(json.dumps({"input": prompt + "? ", "output": answer}))
    root.mkdir(parents=True, exist_ok=True)
    (root / "training.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def _step_time(
    engine: Any, model: Any, optimizer: Any, batches: list[Any], mbs: int, seq: int
) -> float:
    from bridge.train import forward_step

    starts = []
    for micro in batches:
        starts.append(time.perf_counter())
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        engine.forward_backward_func(
            forward_step_func=lambda it, m: forward_step(None, it, m),
            data_iterator=iter(micro),
            model=model,
            num_microbatches=len(micro),
            seq_length=seq,
            micro_batch_size=mbs,
        )
        optimizer.step()
    starts.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(starts[1:])]  # skip the warm-up step
    return statistics.median(gaps)


def _build(seq: int, peft: Any = None) -> tuple[Any, Any, Any]:
    from bridge.train.engine import build_engine
    from bridge.train.peft import apply_peft
    from bridge.train.testing import (
        tiny_dist_config,
        tiny_gpt_provider,
        tiny_optimizer_config,
        tiny_rng_config,
        tiny_scheduler_config,
        tiny_train_config,
    )

    provider = tiny_gpt_provider(
        vocab_size=258, seq_length=seq, hidden_size=128, num_attention_heads=4
    )
    engine = build_engine()
    engine.initialize_distributed(provider, tiny_dist_config(), tiny_rng_config())
    hooks = [] if peft is None else [lambda chunks: apply_peft(peft, chunks)]
    model = engine.setup_model(provider, pre_wrap_hooks=hooks)
    optimizer, _ = engine.setup_optimizer(
        model,
        tiny_optimizer_config(weight_decay=0.0),
        tiny_scheduler_config(lr_decay_style="constant", lr_warmup_iters=0),
        tiny_train_config(),
    )
    return engine, model, optimizer


def _batches(dataset: Any, mbs: int, per_step: int, steps: int) -> list[list[Any]]:
    collate = torch.utils.data.default_collate
    out, index = [], 0
    for _ in range(steps):
        micro = []
        for _ in range(per_step):
            items = [dataset[(index + i) % len(dataset)] for i in range(mbs)]
            index += mbs
            micro.append(collate(items))
        out.append(micro)
    return out


def _optimizer_state_bytes(optimizer: Any) -> int:
    return sum(
        t.numel() * t.element_size()
        for inner in optimizer.chained_optimizers
        for state in inner.optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=256)
    args = parser.parse_args()

    import torch.distributed as dist

    from bridge.train.data.packing import PackedSFTDataset
    from bridge.train.data.sft import SFTDataset, load_tokenized_examples, sft_settings
    from bridge.train.data.tokenizers import ByteLevelTokenizer
    from bridge.train.engine.initialize import destroy_distributed
    from bridge.train.peft import LoRA
    from core_utils.testing import find_free_port

    port = find_free_port()
    tokenizer = ByteLevelTokenizer()
    seq = args.seq_length
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _write_examples(root, 4000)
        examples = load_tokenized_examples(root / "training.jsonl", tokenizer, sft_settings(None))

    unpacked = SFTDataset(examples, seq, tokenizer.pad)
    packed = PackedSFTDataset(examples, seq, tokenizer.pad, shuffle_seed=None)
    per_example = sum(len(ids) - 1 for ids, _ in unpacked.examples) / len(unpacked.examples)
    packed_per_sample = packed.useful_tokens() / len(packed)

    def init() -> None:
        if not dist.is_initialized():
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
            )

    # Same number of samples per step (8 micro-batches of 1): packed samples carry more.
    results: dict[str, list[float]] = {"unpacked": [], "packed": [], "full": [], "lora": []}
    memory: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, dataset, useful in (
            ("unpacked", unpacked, per_example),
            ("packed", packed, packed_per_sample),
        ):
            init()
            engine, model, optimizer = _build(seq)
            step = _step_time(engine, model, optimizer, _batches(dataset, 1, 8, args.steps), 1, seq)
            results[name].append(8 * useful / step)
            destroy_distributed()
        for name, peft in (("full", None), ("lora", LoRA(dim=8, alpha=16.0))):
            init()
            engine, model, optimizer = _build(seq, peft)
            step = _step_time(
                engine, model, optimizer, _batches(unpacked, 4, 2, args.steps), 4, seq
            )
            results[name].append(step)
            memory[name] = _optimizer_state_bytes(optimizer)
            destroy_distributed()

    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"examples: {len(unpacked)}, mean length {per_example:.1f} tokens, seq_length {seq}")
    print(f"packed samples hold {packed_per_sample:.1f} useful tokens on average")
    print(f"unpacked useful tokens/s: {med['unpacked']:.0f}")
    print(f"packed   useful tokens/s: {med['packed']:.0f}")
    print(f"packed / unpacked useful-token throughput: {med['packed'] / med['unpacked']:.2f}x")
    print(
        f"full finetuning step: {med['full'] * 1e3:.1f} ms; LoRA step: {med['lora'] * 1e3:.1f} ms"
    )
    print(f"LoRA / full step time: {med['lora'] / med['full']:.2f}")
    print(
        f"optimizer state: full {memory['full'] / 2**20:.2f} MiB, LoRA "
        f"{memory['lora'] / 2**20:.3f} MiB, ratio {memory['lora'] / memory['full']:.4f}"
    )


if __name__ == "__main__":
    main()
