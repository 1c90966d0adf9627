"""Write a tiny, randomly initialised Llama model in Hugging Face format (for trying
``bridge-convert`` without a download).

::

    uv run python examples/hf_tiny_llama.py /tmp/tiny-llama

Writes ``config.json``, ``model.safetensors``, ``generation_config.json`` and a word-level
tokenizer (``tokenizer.json``, ``tokenizer_config.json``) of 1000 tokens. Needs
``transformers`` (in the workspace's dev group) and ``tokenizers`` (``bridge-train[hf]``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace


def main(out: str) -> None:
    """Save the model and tokenizer into ``out`` (must not exist)."""
    directory = Path(out)
    directory.mkdir(parents=True)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(config).float().save_pretrained(directory)
    vocab = {"</s>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, 1000)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    print(f"wrote a tiny Llama to {directory}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/hf_tiny_llama.py OUT_DIR")
    main(sys.argv[1])
