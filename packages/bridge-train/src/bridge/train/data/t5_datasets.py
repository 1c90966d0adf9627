"""T5 span-corruption data: the config, a generated (mock) dataset and megatron's over files.

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

With ``blend`` or ``blend_per_split`` the samples come from megatron-core's own
``T5MaskedWordPieceDataset`` over indexed (``.bin``/``.idx``) data written by
``bridge-preprocess-data``, through ``BlendedMegatronDatasetBuilder`` (splits, blends, the
index cache), with the tokenizer wrapped by :class:`~bridge.train.data.t5_tokenizer.T5Tokenizer`
(sentinels, ``bos``, ``cls``/``sep``/``mask``). What megatron's dataset would get wrong is
refused by :func:`check_t5_data_config` before anything runs.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.t5_dataset import (
    T5MaskedWordPieceDataset,
    T5MaskedWordPieceDatasetConfig,
)

from bridge.config import (
    ConfigError,
    FinetuningDatasetConfig,
    GPTDatasetConfig,
    TokenizerConfig,
    TokenizerConfigProtocol,
)
from bridge.train.data.datasets import build_gpt_dataset_config, dataset_prefixes
from bridge.train.data.file_checks import read_sequence_lengths
from bridge.train.data.tokenizers import Tokenizer

__all__ = [
    "LONG_SENTENCE_TOKENS",
    "MOCK_SENTINELS",
    "MockT5Dataset",
    "T5DatasetConfig",
    "build_t5_datasets",
    "check_t5_data_config",
    "max_t5_spans",
]

MOCK_SENTINELS = 10
"""Sentinel tokens of the mock data (the top ids of the vocabulary)."""
_PAD, _BOS, _EOS = 0, 1, 2
LONG_SENTENCE_TOKENS = 512
"""megatron's sample index (``helpers.build_mapping``) skips every document holding a
sequence longer than this many tokens."""


@dataclass(kw_only=True)
class T5DatasetConfig(GPTDatasetConfig):
    """T5 span-corruption data: ``sequence_length`` is the encoder length.

    Generated data without ``blend`` / ``blend_per_split``; megatron's
    ``T5MaskedWordPieceDataset`` over indexed files with them.

    Attributes:
        sequence_length_dec: Decoder length (``model.seq_length_dec``).
        masking_probability: Generated data: share of positions that start a corrupted
            span. Indexed data: share of tokens masked (megatron's meaning).
        short_sequence_probability: Indexed data: probability of a sample shorter than
            ``sequence_length`` (megatron).
        masking_max_ngram: Indexed data: longest masked n-gram.
        masking_do_full_word: Indexed data: mask whole words (WordPiece ``##`` pieces).
        masking_do_permutation: Refused when true (megatron's permutation is not seeded).
        masking_use_longer_ngrams: Indexed data: favour longer n-grams.
        masking_use_geometric_distribution: Indexed data: n-gram lengths from SpanBERT's
            geometric distribution.
    """

    sequence_length_dec: int = 32
    masking_probability: float = 0.15
    short_sequence_probability: float = 0.1
    masking_max_ngram: int = 10
    masking_do_full_word: bool = True
    masking_do_permutation: bool = False
    masking_use_longer_ngrams: bool = False
    masking_use_geometric_distribution: bool = False
    # GPT-only options, fixed off (T5 samples carry their own masks).
    reset_position_ids: bool | None = False
    reset_attention_mask: bool | None = False
    eod_mask_loss: bool | None = False
    create_attention_mask: bool = False

    def __post_init__(self) -> None:
        """Check the T5 fields and refuse what the T5 data does not read.

        Raises:
            ValueError: A bad size or probability, a GPT-only option set, or a masking
                option that megatron's dataset cannot honour.
        """

        for name, (valid, rule) in _T5_RANGES.items():
            if not valid(getattr(self, name)):
                raise ConfigError(f"dataset.{name}", f"{rule}, got {getattr(self, name)!r}")
        if self.masking_do_permutation:
            raise ConfigError(
                "dataset.masking_do_permutation",
                "is not supported: megatron draws the permutation from numpy's global random "
                "state, not the sample's seed, so samples would differ between runs and a "
                "resume would not be exact; leave it false",
            )
        for name, default in _GPT_ONLY.items():
            if getattr(self, name) != default:
                raise ConfigError(
                    f"dataset.{name}",
                    f"is a GPT data option; T5 data does not read it (leave it at {default!r})",
                )
        super().__post_init__()
        if self.mock:
            for name, default in _INDEXED_ONLY.items():
                if getattr(self, name) != default:
                    raise ConfigError(
                        f"dataset.{name}",
                        "is read only with indexed data (blend / blend_per_split); the "
                        f"generated data does not use it (leave it at {default!r})",
                    )

    @property
    def is_indexed(self) -> bool:
        """Whether samples come from indexed files (``blend`` / ``blend_per_split``)."""
        return not self.mock


# The T5 fields' valid values: (test, what the message says they must be).
_T5_RANGES: dict[str, tuple[Any, str]] = {
    "sequence_length_dec": (lambda v: isinstance(v, int) and v >= 4, "must be an integer >= 4"),
    "masking_probability": (lambda v: 0.0 < float(v) < 1.0, "must be in (0, 1)"),
    "short_sequence_probability": (lambda v: 0.0 <= float(v) <= 1.0, "must be in [0, 1]"),
    "masking_max_ngram": (lambda v: isinstance(v, int) and v >= 1, "must be an integer >= 1"),
}

# GPTDatasetConfig fields that megatron's T5 dataset (and the generated one) never read.
_GPT_ONLY: dict[str, Any] = {
    "reset_position_ids": False,
    "reset_attention_mask": False,
    "eod_mask_loss": False,
    "create_attention_mask": False,
    "add_extra_token_to_sequence": True,
    "drop_last_partial_validation_sequence": True,
    "inter_document_masking": False,
    "context_parallel_size": None,
    "sequence_parallel_size": 0,
    "hybrid_context_parallel": False,
    "data_parallel_size": 1,
    "object_storage_cache_path": None,
    "sequences_per_dataset": None,
}

_INDEXED_ONLY = {
    "short_sequence_probability": 0.1,
    "masking_max_ngram": 10,
    "masking_do_full_word": True,
    "masking_use_longer_ngrams": False,
    "masking_use_geometric_distribution": False,
}


def max_t5_spans(sequence_length: int, masking_probability: float) -> int:
    """The most spans (and masked tokens) megatron's T5 dataset corrupts in one sample.

    megatron masks at most ``masking_probability x (sequence_length - 2)`` tokens (the
    sample index leaves room for ``bos`` and ``eos``), each span at least one token.
    """
    return int(float(masking_probability) * (int(sequence_length) - 2))


def check_t5_data_config(
    dataset_config: GPTDatasetConfig | FinetuningDatasetConfig,
    tokenizer_config: TokenizerConfig | TokenizerConfigProtocol | None,
) -> None:
    """Refuse an indexed T5 data config that megatron's T5 dataset cannot serve.

    Checks, for indexed data: a tokenizer is configured with enough sentinels
    (``tokenizer.vocab_extra_ids`` >= the most spans of a sample, else megatron runs out of
    sentinels mid-epoch) and the decoder is long enough for the worst case (``bos`` plus a
    sentinel and a token per masked token, else megatron's sample assertion fails).

    Args:
        dataset_config: The run's dataset section.
        tokenizer_config: The run's tokenizer section (or None).

    Raises:
        bridge.config.ConfigError: The field to change and the value that works.
    """

    if not isinstance(dataset_config, T5DatasetConfig) or not dataset_config.is_indexed:
        return
    kind = getattr(tokenizer_config, "tokenizer_type", None)
    if kind is None:
        raise ConfigError(
            "tokenizer.tokenizer_type",
            "indexed T5 data needs the tokenizer the data was written with (e.g. "
            "ByteLevelTokenizer for bridge-preprocess-data's default)",
        )
    spans = max_t5_spans(dataset_config.sequence_length, dataset_config.masking_probability)
    sentinels = int(getattr(tokenizer_config, "vocab_extra_ids", 0) or 0)
    if sentinels < max(1, spans):
        raise ConfigError(
            "tokenizer.vocab_extra_ids",
            f"is {sentinels} but T5 data with sequence_length={dataset_config.sequence_length} "
            f"and masking_probability={dataset_config.masking_probability} corrupts up to "
            f"{spans} spans per sample, one sentinel each; set it to at least {max(1, spans)}",
        )
    needed = 1 + 2 * spans
    if dataset_config.sequence_length_dec < needed:
        raise ConfigError(
            "dataset.sequence_length_dec",
            f"is {dataset_config.sequence_length_dec} but a sample can need {needed} decoder "
            f"tokens (bos, then a sentinel and a token for each of up to {spans} masked "
            "tokens); raise it (and model.seq_length_dec) or lower masking_probability",
        )


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
        sentinel = self.vocab_size - 1
        pos = 0
        spans = 0
        while pos < enc_len:
            span = int(rng.randint(1, 4))
            fits = len(decoder) + 1 + span < dec_len and spans < MOCK_SENTINELS
            if fits and rng.rand() < cfg.masking_probability and pos + span <= enc_len:
                encoder.append(sentinel)
                decoder += [sentinel, *tokens[pos : pos + span].tolist()]
                sentinel -= 1
                spans += 1
                pos += span
            else:
                encoder.append(int(tokens[pos]))
                pos += 1

        def padded(values: list[int], length: int, fill: int) -> np.ndarray:
            out = np.full(length, fill, dtype=np.int64)
            out[: len(values)] = values
            return out

        text_enc = padded(encoder, enc_len, _PAD)
        text_dec = padded(decoder, dec_len, _PAD)
        # The decoder holds no pad id, so its mask is also the loss mask: one label per
        # decoder token (the decoder input shifted left, ending in eos).
        dec_mask = (text_dec != _PAD).astype(np.int64)
        return {
            "text_enc": text_enc,
            "text_dec": text_dec,
            "labels": padded([*decoder[1:], _EOS], dec_len, _PAD),
            "loss_mask": dec_mask.copy(),
            "truncated": 0,
            "enc_mask": (text_enc != _PAD).astype(np.int64),
            "dec_mask": dec_mask,
        }


def build_t5_datasets(
    dataset_config: T5DatasetConfig, tokenizer: Tokenizer, num_samples: tuple[int, int, int]
) -> tuple[Any, Any, Any]:
    """The train, validation and test T5 datasets (``None`` for an empty split).

    Generated data without ``blend``; with it, megatron's ``T5MaskedWordPieceDataset``
    through ``BlendedMegatronDatasetBuilder`` (call it on every rank: megatron's builder lets
    rank 0 build the index cache first).

    Args:
        dataset_config: The T5 dataset config.
        tokenizer: The tokenizer (its ``vocab_size`` bounds the generated ids); for indexed
            data a :class:`~bridge.train.data.t5_tokenizer.T5Tokenizer`.
        num_samples: Samples per split.

    Returns:
        ``(train, valid, test)``.

    Raises:
        TypeError: Indexed data with a tokenizer that has no sentinel tokens.
        FileNotFoundError: A data path does not exist.
    """
    if not dataset_config.is_indexed:
        vocab = int(tokenizer.vocab_size)
        return tuple(  # type: ignore[return-value]
            MockT5Dataset(int(n), dataset_config, vocab, i) if n else None
            for i, n in enumerate(num_samples)
        )
    if not hasattr(tokenizer, "additional_special_tokens_ids"):
        raise TypeError(
            "indexed T5 data needs a tokenizer with sentinel tokens "
            "(bridge.train.data.t5_tokenizer.T5Tokenizer); pretrain wraps the configured one"
        )
    config = build_gpt_dataset_config(
        dataset_config,
        tokenizer,
        T5MaskedWordPieceDatasetConfig,
        sequence_length_decoder=dataset_config.sequence_length_dec,
    )
    for field, prefix in dataset_prefixes(dataset_config):
        lengths = read_sequence_lengths(prefix)
        long = int((lengths > LONG_SENTENCE_TOKENS).sum())
        if long:
            warnings.warn(
                f"{field}: {long} of {len(lengths)} sequences in {prefix!r} are longer than "
                f"{LONG_SENTENCE_TOKENS} tokens; megatron's T5 sample index skips the documents "
                "holding them. Write shorter documents (e.g. one sentence or line each)",
                stacklevel=2,
            )
    sizes = [int(n) for n in num_samples]
    builder = BlendedMegatronDatasetBuilder(T5MaskedWordPieceDataset, sizes, lambda: True, config)
    train_ds, valid_ds, test_ds = builder.build()
    return train_ds, valid_ds, test_ds
