"""A Hugging Face MoE model in and out: import a tiny Qwen3-MoE, finetune it with LoRA at
expert parallelism 2 on two processes, export it and load it in ``transformers``.

::

    uv run python examples/hf_qwen3_moe_lora.py /tmp/qwen3-moe-example

Each step is the command a user runs (printed before it runs, with ``python -m`` for the
console scripts so it uses this interpreter):

1. write a tiny random Qwen3-MoE (4 experts, top-2, a dense layer among the expert layers)
   and a word-level tokenizer with ``transformers`` / ``tokenizers`` (no download);
2. ``bridge-convert import HF CKPT --ep 2``;
3. ``torchrun --nproc-per-node=2 -m bridge.train --config CKPT/iter_0000000/run_config.yaml
   model.expert_model_parallel_size=2 peft._target_=bridge.train.peft.LoRA ...``: LoRA on
   attention and on every expert, each rank holding two of the four experts (megatron
   engine; CPU and gloo work);
4. ``bridge-convert export LORA OUT`` (adapters folded into the weights);
5. ``AutoModelForCausalLM.from_pretrained(OUT)``: the finetuned model, which differs from
   the original in its attention and expert weights and not in its router.

Needs ``transformers`` (the workspace's dev group) and ``bridge-train[hf]``. About a minute
on an idle 2-core CPU.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

VOCAB = 1000


def write_tiny_qwen3_moe(directory: Path) -> None:
    """A random Qwen3-MoE and a word-level tokenizer of ``VOCAB`` tokens."""
    torch.manual_seed(0)
    # head_dim is read from the keyword arguments (not a declared field of the config).
    settings: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        mlp_only_layers=[1],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    config = transformers.Qwen3MoeConfig(**settings)
    transformers.Qwen3MoeForCausalLM(config).float().save_pretrained(directory)
    vocab = {"</s>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))


def run(*argv: str) -> None:
    """Run one step, printing it first; stop the example if it fails."""
    print(f"$ {shlex.join(argv)}", flush=True)
    subprocess.run(argv, check=True)


def main(out: str) -> None:
    """Run the five steps under ``out`` (must not exist)."""
    root = Path(out)
    root.mkdir(parents=True)
    hf, ckpt, lora, exported = root / "hf", root / "ckpt", root / "lora", root / "lora-hf"
    write_tiny_qwen3_moe(hf)
    print(f"wrote a tiny Qwen3-MoE to {hf}")
    python = sys.executable
    run(python, "-m", "bridge.train.convert", "import", str(hf), str(ckpt), "--ep", "2", "--quiet")
    run(
        python,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "-m",
        "bridge.train",
        "--config",
        str(ckpt / "iter_0000000" / "run_config.yaml"),
        "--no-print-config",
        f"checkpoint.save={lora}",
        "model.expert_model_parallel_size=2",
        "model.seq_length=32",
        "dataset.sequence_length=32",
        "train.train_iters=10",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "train.eval_iters=0",
        "scheduler.lr_warmup_iters=0",
        "logger.log_interval=5",
        "peft._target_=bridge.train.peft.LoRA",
        "peft.dim=8",
        "peft.alpha=16",
    )
    run(python, "-m", "bridge.train.convert", "export", str(lora), str(exported), "--quiet")
    model = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    tuned, original = dict(model.named_parameters()), dict(base.named_parameters())
    changed = sorted(n for n, p in tuned.items() if not torch.equal(p, original[n]))
    print(f"loaded {type(model).__name__} from {exported}; {len(changed)} tensors finetuned, e.g.")
    for name in changed[:3]:
        print(f"  {name}")
    tokens = torch.arange(2, 18).unsqueeze(0)
    with torch.no_grad():
        print("next-token logits (first 4):", model(tokens).logits[0, -1, :4].tolist())


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/hf_qwen3_moe_lora.py OUT_DIR")
    main(sys.argv[1])
