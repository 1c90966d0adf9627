"""T5 span-corruption data: the config and a generated (mock) dataset.

Samples have the keys and layout of megatron-core's ``T5MaskedWordPieceDataset``:
``text_enc`` (encoder input with each corrupted span replaced by one sentinel token),
``text_dec`` (``bos`` then, per span, its sentinel and its tokens), ``labels`` (the decoder
input shifted left, ending in ``eos``), ``loss_mask``, ``enc_mask`` / ``dec_mask`` (1 on
tokens, 0 on padding) and ``truncated``. Padding is token 0.

The mock dataset draws, per sample index, a counting sequence (``start, start+1, ...``
modulo the content vocabulary, like megatron's mock GPT data, so a model can learn it) and
corrupts spans with ``masking_probability`` per position (span lengths 1-3) while the
decoder side fits ``sequence_length_dec``. Token ids: 0 pad, 1 bos, 2 eos, the top
:data:`MOCK_SENTINELS` ids of the vocabulary are the sentinels, the rest is content.
Reading indexed (``.bin``/``.idx``) data through megatron's T5 dataset is not implemented
here: a config with ``blend`` is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bridge.config import GPTDatasetConfig

__all__ = ["MOCK_SENTINELS", "MockT5Dataset", "T5DatasetConfig", "build_t5_datasets"]

MOCK_SENTINELS = 10
"""Sentinel tokens of the mock data (the top ids of the vocabulary)."""
_PAD, _BOS, _EOS = 0, 1, 2


@dataclass(kw_only=True)
class T5DatasetConfig(GPTDatasetConfig):
    """T5 span-corruption data: ``sequence_length`` is the encoder length.

    Attributes:
        sequence_length_dec: Decoder length (``model.seq_length_dec``).
        masking_probability: Share of positions that start a corrupted span.
    """

    sequence_length_dec: int = 32
    masking_probability: float = 0.15
    # GPT-only options, fixed off (T5 samples carry their own masks).
    reset_position_ids: bool | None = False
    reset_attention_mask: bool | None = False
    eod_mask_loss: bool | None = False
    create_attention_mask: bool = False

    def __post_init__(self) -> None:
        """Check the T5 fields and refuse what the T5 data does not read.

        Raises:
            ValueError: A bad size or probability, indexed data (``blend``), or a GPT-only
                option set.
        """
        from bridge.config import ConfigError

        if self.blend is not None or self.blend_per_split is not None:
            raise ConfigError(
                "dataset.blend",
                "indexed T5 data is not supported yet (megatron's T5 dataset needs a tokenizer "
                "with sentinel tokens, cls/sep/mask ids and inv_vocab, which the project's "
                "tokenizers lack); leave blend unset for generated data",
            )
        if not isinstance(self.sequence_length_dec, int) or self.sequence_length_dec < 4:
            raise ConfigError(
                "dataset.sequence_length_dec",
                f"must be an integer >= 4, got {self.sequence_length_dec!r}",
            )
        if not 0.0 < float(self.masking_probability) < 1.0:
            raise ConfigError(
                "dataset.masking_probability",
                f"must be in (0, 1), got {self.masking_probability!r}",
            )
        for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
            if getattr(self, name):
                raise ConfigError(f"dataset.{name}", "is a GPT option; T5 data does not read it")
        self.mock = True
        super().__post_init__()


class MockT5Dataset(torch.utils.data.Dataset):
    """Generated span-corruption samples (see the module docstring).

    Args:
        num_samples: Length of the dataset.
        config: The dataset config.
        vocab_size: Vocabulary size (>= ``MOCK_SENTINELS + 8``).
        split_index: 0 train, 1 validation, 2 test (separates the random streams).
    """

    def __init__(
        self, num_samples: int, config: T5DatasetConfig, vocab_size: int, split_index: int
    ) -> None:
        if vocab_size < MOCK_SENTINELS + 8:
            raise ValueError(
                f"mock T5 data needs a vocabulary of at least {MOCK_SENTINELS + 8}, got "
                f"{vocab_size}"
            )
        self.num_samples = num_samples
        self.config = config
        self.vocab_size = vocab_size
        self.split_index = split_index
        self.first_content = 3
        self.num_content = vocab_size - MOCK_SENTINELS - self.first_content

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, Any]:
        cfg = self.config
        enc_len, dec_len = cfg.sequence_length, cfg.sequence_length_dec
        seed = (cfg.random_seed * 1_000_003 + self.split_index * 7_919 + idx) % 2**32
        rng = np.random.RandomState(seed)
        start = rng.randint(self.num_content)
        tokens = self.first_content + (start + np.arange(enc_len)) % self.num_content

        encoder: list[int] = []
        decoder = [_BOS]
        labels: list[int] = []
        sentinel = self.vocab_size - 1
        pos = 0
        spans = 0
        while pos < enc_len:
            span = int(rng.randint(1, 4))
            fits = len(decoder) + 1 + span < dec_len and spans < MOCK_SENTINELS
            if fits and rng.rand() < cfg.masking_probability and pos + span <= enc_len:
                encoder.append(sentinel)
                decoder += [sentinel, *tokens[pos : pos + span].tolist()]
                labels += [sentinel, *tokens[pos : pos + span].tolist()]
                sentinel -= 1
                spans += 1
                pos += span
            else:
                encoder.append(int(tokens[pos]))
                pos += 1
        labels.append(_EOS)

        def padded(values: list[int], length: int, fill: int) -> np.ndarray:
            out = np.full(length, fill, dtype=np.int64)
            out[: len(values)] = values
            return out

        text_enc = padded(encoder, enc_len, _PAD)
        text_dec = padded(decoder, dec_len, _PAD)
        loss_mask = np.zeros(dec_len, dtype=np.int64)
        loss_mask[: len(decoder)] = 1
        return {
            "text_enc": text_enc,
            "text_dec": text_dec,
            "labels": padded(labels, dec_len, _PAD),
            "loss_mask": loss_mask,
            "truncated": 0,
            "enc_mask": (text_enc != _PAD).astype(np.int64),
            "dec_mask": (text_dec != _PAD).astype(np.int64),
        }


def build_t5_datasets(
    dataset_config: T5DatasetConfig, tokenizer: Any, num_samples: tuple[int, int, int]
) -> tuple[Any, Any, Any]:
    """The train, validation and test T5 datasets (``None`` for an empty split).

    Args:
        dataset_config: The T5 dataset config.
        tokenizer: The tokenizer (its ``vocab_size`` bounds the generated ids).
        num_samples: Samples per split.

    Returns:
        ``(train, valid, test)``.
    """
    vocab = int(tokenizer.vocab_size)
    return tuple(  # type: ignore[return-value]
        MockT5Dataset(int(n), dataset_config, vocab, i) if n else None
        for i, n in enumerate(num_samples)
    )
