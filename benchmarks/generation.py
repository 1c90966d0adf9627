"""Generation speed: bridge-generate's machinery against ``transformers``' ``generate``.

A random Llama-style model (grouped-query attention, SwiGLU, untied embeddings; about 25 M
parameters at the default size, fp32) is written in Hugging Face format, imported with
``bridge-convert``'s API, and exported back (so the model ``transformers`` runs is the
exported one, bit-identical to the imported weights). In one process, alternating rounds:

* bridge: :func:`bridge.train.generate.load_generation_model` +
  :class:`~bridge.train.generate.TextGenerator` (megatron-core's static-batch text generation
  controller and KV cache on the trainer's megatron engine; on CPU under the CUDA
  emulation), the code ``bridge-generate`` runs;
* transformers: ``AutoModelForCausalLM.from_pretrained(export)`` and ``model.generate``
  (its dynamic KV cache), with the same prompts, greedy, past the end-of-sequence token.

Batch 1 (one prompt) and batch 8 (eight prompts of 16 to 64 tokens; transformers gets them
left-padded with an attention mask, the usual way to batch prompts of different lengths).
For each: generated tokens per second (medians over rounds, ratio bridge / transformers: > 1
means bridge is faster) and, at batch 1, the time to the first generated token (measured
with each library's streaming hook: bridge's ``on_text`` callback, transformers' streamer).
Both generate the same greedy tokens (checked at batch 1). It asserts nothing else. Run from
the repository root::

    uv run python benchmarks/generation.py [--hidden 512] [--layers 6] [--new-tokens 64]
        [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def _write_model(directory: Path, hidden: int, layers: int, vocab: int, seq: int) -> None:
    import transformers

    from bridge.train.testing import write_word_level_tokenizer

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=seq,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config).float()
    model.save_pretrained(directory)
    write_word_level_tokenizer(directory, vocab)


def _prompts(vocab: int, batch: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(batch)
    lengths = [32] if batch == 1 else [16 + (48 * i) // (batch - 1) for i in range(batch)]
    return [torch.randint(2, vocab, (n,), generator=generator).tolist() for n in lengths]


class _FirstToken:
    """A transformers streamer that notes when the first generated token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # the first call holds the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def _mark(marks: list[float], index: int, text: str, done: bool) -> None:
    marks.append(time.perf_counter())


def _hf_generate(model: Any, prompts: list[list[int]], new: int, streamer: Any = None) -> Any:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            streamer=streamer,
        )
    return out[:, width:]


def main() -> None:
    """Measure and print the table (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import transformers

    from bridge.train.convert import export_hf_checkpoint, import_hf_checkpoint
    from bridge.train.generate import SamplingOptions, load_generation_model

    seq = 64 + args.new_tokens
    work = Path(tempfile.mkdtemp(prefix="bench-generation-"))
    _write_model(work / "hf", args.hidden, args.layers, args.vocab, seq)
    import_hf_checkpoint(work / "hf", work / "ckpt", seq_length=seq)
    export_hf_checkpoint(work / "ckpt", work / "export")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(work / "export").eval()
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 0
    loaded = load_generation_model(work / "ckpt")
    params = sum(p.numel() for p in hf_model.parameters())
    try:
        generator = loaded.generator(max_batch_size=8)
        options = SamplingOptions(args.new_tokens, stop_at_eod=False)
        print(
            f"model: {params / 1e6:.1f} M parameters (hidden {args.hidden}, {args.layers} "
            f"layers, vocabulary {args.vocab}), fp32, {args.new_tokens} new tokens, "
            f"{args.threads} torch threads, {args.rounds} rounds"
        )
        # Warm-up (and the check that both generate the same tokens).
        warm = _prompts(args.vocab, 1)
        ours = generator.generate(warm, options)[0].token_ids
        theirs = _hf_generate(hf_model, warm, args.new_tokens)[0].tolist()
        print(f"same greedy tokens at batch 1: {ours == theirs}")
        for batch in (1, 8):
            prompts = _prompts(args.vocab, batch)
            times: dict[str, list[float]] = {"bridge": [], "transformers": []}
            first: dict[str, list[float]] = {"bridge": [], "transformers": []}
            for _ in range(args.rounds):
                start = time.perf_counter()
                marks: list[float] = []
                generator.generate(
                    prompts,
                    options,
                    on_text=functools.partial(_mark, marks) if batch == 1 else None,
                )
                times["bridge"].append(time.perf_counter() - start)
                if marks:
                    first["bridge"].append(marks[0] - start)
                streamer = _FirstToken() if batch == 1 else None
                start = time.perf_counter()
                _hf_generate(hf_model, prompts, args.new_tokens, streamer)
                times["transformers"].append(time.perf_counter() - start)
                if streamer is not None and streamer.first is not None:
                    first["transformers"].append(streamer.first - start)
            tokens = batch * args.new_tokens
            rate = {k: tokens / statistics.median(v) for k, v in times.items()}
            print(
                f"batch {batch}: bridge {rate['bridge']:.1f} tokens/s, transformers "
                f"{rate['transformers']:.1f} tokens/s, ratio {rate['bridge'] / rate['transformers']:.3f}"
            )
            if batch == 1:
                ttft = {k: statistics.median(v) * 1e3 for k, v in first.items()}
                print(
                    f"batch 1 time to first token: bridge {ttft['bridge']:.1f} ms, transformers "
                    f"{ttft['transformers']:.1f} ms, ratio {ttft['transformers'] / ttft['bridge']:.3f}"
                    " (> 1: bridge is faster)"
                )
    finally:
        loaded.close()


if __name__ == "__main__":
    main()
