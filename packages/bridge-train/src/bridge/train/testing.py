"""Tiny configs for tests and benchmarks of the trainer (CPU-sized, deterministic).

Every factory takes keyword overrides. The model defaults use a vocabulary of 128 padded to
a multiple of 64 x TP, so tensor-parallel sizes 1 and 2 build identical full weights, and no
dropout, so runs are comparable across parallel layouts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from megatron.core.optimizer import OptimizerConfig

from bridge.config import (
    CheckpointConfig,
    ConfigContainer,
    DistributedInitConfig,
    FinetuningDatasetConfig,
    GPTDatasetConfig,
    LoggerConfig,
    MockGPTDatasetConfig,
    RNGConfig,
    SchedulerConfig,
    TokenizerConfig,
    TrainingConfig,
)
from bridge.train.data.datasets import build_train_valid_test_datasets
from bridge.train.data.loaders import build_train_valid_test_data_iterators
from bridge.train.data.tokenizers import NullTokenizer
from bridge.train.models.gpt_provider import GPTModelProvider
from bridge.train.state import TrainState

__all__ = [
    "TINY_VOCAB",
    "SampleRecorder",
    "tiny_config_container",
    "tiny_dist_config",
    "tiny_gpt_provider",
    "tiny_mock_dataset_config",
    "tiny_mock_iterator",
    "tiny_optimizer_config",
    "tiny_rng_config",
    "tiny_scheduler_config",
    "tiny_train_config",
    "write_tiny_sft_task",
    "write_word_level_tokenizer",
]

TINY_VOCAB = 128
"""Vocabulary size of the tiny model and of the null tokenizer of its mock data."""


class SampleRecorder:
    """Wraps a forward step's micro-batch iterator and appends, for every sample it hands
    out, a line ``"<iteration> <digest>"`` to ``path`` (the iteration being trained, read
    from ``train_state.step``; the digest: the first 16 hex digits of the SHA-256 of the
    sample's tokens). Which samples each iteration consumed, checkable across restarts and
    layouts: wrap the iterator inside the forward step (one file per rank), e.g.
    ``SampleRecorder(data_iterator, state.train_state, path)``.
    """

    def __init__(self, inner: Iterator[Any], train_state: TrainState, path: str | Path) -> None:
        self.inner, self.train_state, self.path = inner, train_state, Path(path)

    def __iter__(self) -> SampleRecorder:
        return self

    def __next__(self) -> Any:
        batch = next(self.inner)
        step = int(self.train_state.step)
        with self.path.open("a", encoding="utf-8") as out:
            for row in batch["tokens"]:
                digest = hashlib.sha256(row.cpu().numpy().tobytes()).hexdigest()[:16]
                out.write(f"{step} {digest}\n")
        return batch


def tiny_gpt_provider(**overrides: Any) -> GPTModelProvider:
    """2 layers, hidden 32, 4 heads, sequence 16, vocabulary 128, no dropout."""
    values: dict[str, Any] = {
        "num_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "seq_length": 16,
        "vocab_size": TINY_VOCAB,
        "make_vocab_size_divisible_by": 64,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    }
    return GPTModelProvider(**(values | overrides))


def tiny_optimizer_config(**overrides: Any) -> Any:
    """megatron ``OptimizerConfig``: Adam, lr 1e-3 (min 1e-4), weight decay 0.1, clip 1.0."""

    values: dict[str, Any] = {
        "optimizer": "adam",
        "lr": 1e-3,
        "min_lr": 1e-4,
        "weight_decay": 0.1,
        "clip_grad": 1.0,
        "log_num_zeros_in_grad": True,
    }
    return OptimizerConfig(**(values | overrides))


def tiny_scheduler_config(**overrides: Any) -> SchedulerConfig:
    """Cosine decay with one warm-up iteration."""
    return SchedulerConfig(**{"lr_decay_style": "cosine", "lr_warmup_iters": 1, **overrides})


def tiny_train_config(**overrides: Any) -> TrainingConfig:
    """5 iterations, global batch 4, micro batch 2, no evaluation."""
    values: dict[str, Any] = {
        "train_iters": 5,
        "global_batch_size": 4,
        "micro_batch_size": 2,
        "eval_iters": 0,
        "eval_interval": None,
    }
    return TrainingConfig(**(values | overrides))


def tiny_mock_dataset_config(**overrides: Any) -> MockGPTDatasetConfig:
    """Mock GPT data of sequence 16, single pass, no worker processes."""
    values: dict[str, Any] = {
        "random_seed": 1234,
        "sequence_length": 16,
        "reset_position_ids": False,
        "reset_attention_mask": False,
        "eod_mask_loss": False,
        "num_workers": 0,
        "dataloader_type": "single",
        "create_attention_mask": False,
    }
    return MockGPTDatasetConfig(**(values | overrides))


def tiny_dist_config(**overrides: Any) -> DistributedInitConfig:
    """gloo, 2-minute timeout."""
    values: dict[str, Any] = {"distributed_backend": "gloo", "distributed_timeout_minutes": 2}
    return DistributedInitConfig(**(values | overrides))


def tiny_rng_config(**overrides: Any) -> RNGConfig:
    """Seed 1234."""
    return RNGConfig(**{"seed": 1234, **overrides})


def tiny_mock_iterator(
    train_config: TrainingConfig,
    dataset_config: GPTDatasetConfig | FinetuningDatasetConfig | None = None,
    train_state: TrainState | None = None,
) -> Iterator[Any]:
    """This rank's training iterator over mock data sized for ``train_config``.

    Needs megatron's parallel state (the data-parallel rank and size are read from it).
    """
    dataset_config = dataset_config if dataset_config is not None else tiny_mock_dataset_config()
    tokenizer = NullTokenizer(TINY_VOCAB)
    assert train_config.train_iters is not None and train_config.global_batch_size is not None
    samples = train_config.train_iters * train_config.global_batch_size
    datasets = build_train_valid_test_datasets(dataset_config, tokenizer, (samples, 0, 0))
    train_it, _, _ = build_train_valid_test_data_iterators(
        datasets, dataset_config, train_config, train_state or TrainState()
    )
    assert train_it is not None
    return train_it


def tiny_config_container(**sections: Any) -> ConfigContainer:
    """A complete run config for :func:`bridge.train.pretrain` built from the factories above.

    Mock data with the null tokenizer (vocabulary 128), 5 iterations of global batch 4,
    no evaluation, log every iteration, no checkpoints, gloo. Pass sections to replace
    (``train=tiny_train_config(train_iters=20)``, ``checkpoint=CheckpointConfig(save=...)``).
    """
    values: dict[str, Any] = {
        "train": tiny_train_config(),
        "model": tiny_gpt_provider(),
        "optimizer": tiny_optimizer_config(),
        "scheduler": tiny_scheduler_config(),
        "dataset": tiny_mock_dataset_config(),
        "tokenizer": TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=TINY_VOCAB),
        "logger": LoggerConfig(log_interval=1),
        "checkpoint": CheckpointConfig(),
        "dist": tiny_dist_config(),
        "rng": tiny_rng_config(),
    }
    return ConfigContainer(**(values | sections))


def write_tiny_sft_task(root: str | Path, train: int = 64, valid: int = 8) -> Path:
    """Write a learnable SFT task: ``{"input": "3+4=", "output": "7"}`` records.

    ``training.jsonl`` (``train`` records), ``validation.jsonl`` and ``test.jsonl``
    (``valid`` each) under ``root``, drawn from a fixed seed (the same files every time).

    Returns:
        ``root`` as a ``Path``.
    """

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    for name, count in (("training", train), ("validation", valid), ("test", valid)):
        pairs = torch.randint(0, 10, (count, 2), generator=generator).tolist()
        lines = [json.dumps({"input": f"{a}+{b}=", "output": str(a + b)}) for a, b in pairs]
        (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


def write_word_level_tokenizer(directory: str | Path, size: int) -> Path:
    """Save a Hugging Face word-level tokenizer of ``size`` ids into ``directory``.

    Ids: ``</s>`` 0 (the end-of-sequence token), ``<unk>`` 1, then ``w2`` ... ``w<size-1>``
    (text ``"w5 w7"`` is ids ``[5, 7]``, whitespace-separated). Writes ``tokenizer.json`` and
    ``tokenizer_config.json``. Needs the ``tokenizers`` package (``bridge-train[hf]``).
    """
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {"</s>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, size)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return directory
