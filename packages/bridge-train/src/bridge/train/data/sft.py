"""Supervised finetuning (SFT) datasets from ``FinetuningDatasetConfig``.

``dataset.dataset_root`` holds ``training.jsonl`` and, as ``do_validation`` / ``do_test``
ask, ``validation.jsonl`` / ``test.jsonl``. A line is one example, either

* a prompt/answer record: ``{"input": "...", "output": "..."}`` (keys set by
  ``dataset_kwargs.prompt_key`` / ``answer_key``; the prompt text is
  ``dataset_kwargs.prompt_template`` formatted with the record's fields, default
  ``"{input}"``), or
* a chat record: ``{"messages": [{"role": "user", "content": "..."}, ...]}``, rendered with
  the tokenizer's ``apply_chat_template`` when it has one, else as
  ``"<|role|>\\n" + content + "\\n"`` per message.

Loss is on answer tokens only (the answer and the end-of-document token after it; every
assistant message of a chat): ``loss_mask`` is 0 on prompt tokens and padding, so they
carry neither loss nor gradient.

A sample is ``seq_length`` tokens (``tokens`` = ids[:-1], ``labels`` = ids[1:]); shorter
examples are padded at the end (causal attention never sees the padding). Longer ones follow
``dataset_kwargs.truncation``: ``"left"`` (default) drops tokens from the start, so the
answer survives; ``"right"`` drops the end; ``"drop"`` skips the example. An example left
without any answer token is skipped (and counted in the log).

Order: the training split is shuffled with ``dataset.seed``, a new permutation per epoch;
the dataset is as long as the run needs (whole epochs), so sample ``i`` is always the same
example and a resumed run continues at its consumed-samples count with nothing replayed.
``max_train_samples`` keeps the first that many training records (file order). Validation
and test keep file order.

Tokenized records are cached next to the data (``<dataset_root>/.sft_cache``, or
``dataset_kwargs.cache_dir``) under a key of the file's bytes, the tokenizer and the
rendering settings, so a second run does not tokenize again; ``memmap_workers`` processes
tokenize a file when it is not cached.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bridge.config import ConfigError, FinetuningDatasetConfig
from bridge.config.atomic_files import atomic_write
from bridge.train.data.preprocess import jsonl_records
from bridge.train.data.tokenizers import Tokenizer, map_in_processes

__all__ = [
    "SFT_SPLIT_FILES",
    "SFTDataset",
    "SFTSettings",
    "TokenizedExamples",
    "build_sft_datasets",
    "chat_generation_prompt",
    "check_finetuning_dataset",
    "epoch_order",
    "load_tokenized_examples",
    "sft_settings",
]

logger = logging.getLogger(__name__)

SFT_SPLIT_FILES = ("training.jsonl", "validation.jsonl", "test.jsonl")
"""File names of the train, validation and test splits under ``dataset_root``."""

TRUNCATION_POLICIES = ("left", "right", "drop")

# What starts a message of a role (the format's field) without a tokenizer chat template.
_CHAT_HEADER = "<|{}|>\n"


@dataclass(frozen=True)
class SFTSettings:
    """How records are rendered, tokenized and cut (from ``dataset.dataset_kwargs``).

    Attributes:
        prompt_key: Record key of the prompt.
        answer_key: Record key of the answer.
        prompt_template: ``str.format`` template over the record's fields giving the prompt
            text (default ``"{<prompt_key>}"``).
        truncation: ``"left"``, ``"right"`` or ``"drop"`` for examples longer than a sample.
        add_eod: Append the end-of-document token to every answer (it gets loss, so the
            model learns where an answer stops).
        cache_dir: Directory of the tokenized cache (``None``: ``<dataset_root>/.sft_cache``).
    """

    prompt_key: str = "input"
    answer_key: str = "output"
    prompt_template: str | None = None
    truncation: str = "left"
    add_eod: bool = True
    cache_dir: str | None = None

    @property
    def template(self) -> str:
        """The prompt template in effect."""
        return self.prompt_template or "{" + self.prompt_key + "}"


def sft_settings(dataset_kwargs: dict[str, Any] | None) -> SFTSettings:
    """Read ``dataset.dataset_kwargs`` into :class:`SFTSettings`.

    Raises:
        bridge.config.ConfigError: An unknown key or a bad value (named
            ``dataset.dataset_kwargs.<key>``).
    """

    values: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(SFTSettings)}
    for key, value in (dataset_kwargs or {}).items():
        if key not in values:
            raise ConfigError(
                f"dataset.dataset_kwargs.{key}",
                f"is not a finetuning dataset option; known options: {sorted(values)}",
            )
        values[key] = value
    for key, (valid, rule) in _SETTING_RULES.items():
        if not valid(values[key]):
            raise ConfigError(f"dataset.dataset_kwargs.{key}", f"{rule}, got {values[key]!r}")
    return SFTSettings(**values)


# What each SFTSettings field must be: (test, what the message says it must be).
_SETTING_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "prompt_key": (lambda v: isinstance(v, str) and bool(v), "must be a non-empty string"),
    "answer_key": (lambda v: isinstance(v, str) and bool(v), "must be a non-empty string"),
    "prompt_template": (lambda v: v is None or isinstance(v, str), "must be a string"),
    "truncation": (lambda v: v in TRUNCATION_POLICIES, f"use one of {list(TRUNCATION_POLICIES)}"),
    "add_eod": (lambda v: isinstance(v, bool), "must be true or false"),
    "cache_dir": (
        lambda v: v is None or isinstance(v, str | os.PathLike),
        "must be a directory path",
    ),
}


def _split_paths(dataset_config: FinetuningDatasetConfig) -> list[tuple[str, Path | None]]:
    """``(field, path or None)`` per split: the flag that asks for it and its file."""
    assert dataset_config.dataset_root is not None  # check_finetuning_dataset refuses None
    root = Path(dataset_config.dataset_root)
    wanted = (True, dataset_config.do_validation, dataset_config.do_test)
    fields = ("dataset.dataset_root", "dataset.do_validation", "dataset.do_test")
    return [
        (field, root / name if want else None)
        for field, name, want in zip(fields, SFT_SPLIT_FILES, wanted, strict=True)
    ]


def check_finetuning_dataset(dataset_config: FinetuningDatasetConfig) -> None:
    """Refuse a ``FinetuningDatasetConfig`` the trainer cannot honour, before anything runs.

    Raises:
        bridge.config.ConfigError: Missing ``dataset_root`` or split files, unknown
            ``dataset_kwargs``, ``dataloader_type: external``; the message names the field
            and the fix. (``data_sharding: false`` is refused for every dataset by the
            launch checks.)
    """

    if dataset_config.dataset_root is None:
        raise ConfigError(
            "dataset.dataset_root",
            "is required for finetuning; point it at a directory holding training.jsonl",
        )
    root = Path(dataset_config.dataset_root)
    if not root.is_dir():
        raise ConfigError("dataset.dataset_root", f"{str(root)!r} is not a directory")
    for field, path in _split_paths(dataset_config):
        if path is not None and not path.is_file():
            fix = (
                f"add {path.name} there"
                if field == "dataset.dataset_root"
                else f"add {path.name} or set {field}=false"
            )
            raise ConfigError(field, f"{str(path)!r} does not exist; {fix}")
    sft_settings(dataset_config.dataset_kwargs)
    if dataset_config.dataloader_type == "external":
        raise ConfigError(
            "dataset.dataloader_type",
            "'external' means the caller supplies iterators, but a finetuning dataset is built "
            "from dataset_root; use 'single' or 'cyclic'",
        )


@dataclass
class TokenizedExamples:
    """Tokenized records of one file: ids and a loss flag per token, concatenated.

    Attributes:
        tokens: All token ids (int32), record after record.
        loss_flags: 1 where the token is part of an answer (uint8), same length.
        offsets: ``offsets[i]:offsets[i+1]`` is record ``i`` (int64, length records + 1).
    """

    tokens: np.ndarray
    loss_flags: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def example(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, loss_flags)`` of record ``index``."""
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return self.tokens[start:end], self.loss_flags[start:end]

    def head(self, count: int) -> TokenizedExamples:
        """The first ``count`` records."""
        if count >= len(self):
            return self
        end = int(self.offsets[count])
        return TokenizedExamples(
            self.tokens[:end], self.loss_flags[:end], self.offsets[: count + 1].copy()
        )


def _render_chat(tokenizer: Tokenizer, messages: Any, where: str) -> tuple[list[int], list[int]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list")
    ids: list[int] = []
    flags: list[int] = []
    apply_template = getattr(tokenizer, "apply_chat_template", None)
    for turn, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"{where}: message {turn} needs 'role' and 'content'")
        role, content = str(message["role"]), str(message["content"])
        if apply_template is not None:
            # Render the conversation up to this message and keep only the new tokens, so
            # each message's tokens can be flagged by role.
            text = apply_template(messages[: turn + 1], tokenize=False)
            previous = apply_template(messages[:turn], tokenize=False) if turn else ""
            new = tokenizer.tokenize(text[len(previous) :])
        else:
            header = tokenizer.tokenize(_CHAT_HEADER.format(role))
            ids += header
            flags += [0] * len(header)
            new = tokenizer.tokenize(content + "\n")
        ids += new
        flags += [1 if role == "assistant" else 0] * len(new)
    return ids, flags


def chat_generation_prompt(tokenizer: Tokenizer, messages: Any) -> list[int]:
    """Token ids of ``messages`` rendered as chat training records are, followed by the
    start of an assistant message: the prompt from which a chat-finetuned model answers.

    Args:
        tokenizer: The tokenizer of the finetuned model.
        messages: ``[{"role": ..., "content": ...}, ...]``.

    Raises:
        ValueError: ``messages`` is not a non-empty list of role/content messages.
    """
    ids, _ = _render_chat(tokenizer, messages, "chat prompt")
    apply_template = getattr(tokenizer, "apply_chat_template", None)
    if apply_template is not None:
        rendered = apply_template(messages, tokenize=False)
        opened = apply_template(messages, tokenize=False, add_generation_prompt=True)
        return ids + list(tokenizer.tokenize(opened[len(rendered) :]))
    return ids + list(tokenizer.tokenize(_CHAT_HEADER.format("assistant")))


def _tokenize_record(
    tokenizer: Tokenizer, settings: SFTSettings, path: Path, line: tuple[int, Any, int]
) -> tuple[list[int], list[int]]:
    number, record, _ = line
    where = f"{path} line {number}"
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        ids, flags = _render_chat(tokenizer, record["messages"], where)
    else:
        if settings.answer_key not in record:
            raise ValueError(
                f"{where}: no {settings.answer_key!r} key (the answer); set "
                "dataset.dataset_kwargs.answer_key, or give chat records with 'messages'"
            )
        try:
            prompt = settings.template.format(**record)
        except KeyError as exc:
            raise ValueError(
                f"{where}: the prompt template {settings.template!r} needs key {exc}; set "
                "dataset.dataset_kwargs.prompt_key or prompt_template"
            ) from None
        prompt_ids = tokenizer.tokenize(prompt)
        answer_ids = tokenizer.tokenize(str(record[settings.answer_key]))
        ids = prompt_ids + answer_ids
        flags = [0] * len(prompt_ids) + [1] * len(answer_ids)
    if settings.add_eod:
        ids.append(int(tokenizer.eod))
        flags.append(1)
    return ids, flags


def _tokenize_file(
    path: Path, tokenizer: Tokenizer, settings: SFTSettings, workers: int
) -> TokenizedExamples:
    records = list(jsonl_records(path))
    if not records:
        raise ValueError(f"{path}: no records")
    tokenize = functools.partial(_tokenize_record, tokenizer, settings, path)
    results = list(map_in_processes(tokenize, records, workers))
    lengths = [len(ids) for ids, _ in results]
    offsets = np.zeros(len(results) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.fromiter((t for ids, _ in results for t in ids), dtype=np.int32, count=offsets[-1])
    flags = np.fromiter((f for _, fl in results for f in fl), dtype=np.uint8, count=offsets[-1])
    return TokenizedExamples(tokens, flags, offsets)


def _cache_key(path: Path, tokenizer: Tokenizer, settings: SFTSettings) -> str:
    digest = hashlib.sha256()
    digest.update(path.read_bytes())
    identifiers = getattr(tokenizer, "unique_identifiers", None) or {"class": type(tokenizer)}
    digest.update(repr(sorted((str(k), repr(v)) for k, v in identifiers.items())).encode())
    digest.update(
        repr(
            (settings.prompt_key, settings.answer_key, settings.template, settings.add_eod)
        ).encode()
    )
    digest.update(b"sft-cache-v1")
    return digest.hexdigest()[:24]


def load_tokenized_examples(
    path: str | Path,
    tokenizer: Tokenizer,
    settings: SFTSettings,
    *,
    cache_dir: str | Path | None = None,
    workers: int = 1,
) -> TokenizedExamples:
    """Tokenize a JSONL file of SFT records, or load its tokenized cache.

    The cache file name holds a hash of the file's bytes, the tokenizer's
    ``unique_identifiers`` and the rendering settings; it is written atomically, so ranks
    tokenizing the same file at once both leave a complete cache. A cache that cannot be
    read is tokenized again (and rewritten); a directory that cannot be written only costs
    the cache.

    Args:
        path: The JSONL file.
        tokenizer: Tokenizer with ``tokenize`` and ``eod``.
        settings: Rendering settings.
        cache_dir: Directory of the cache (``None``: no cache).
        workers: Processes tokenizing an uncached file.

    Returns:
        The tokenized records.

    Raises:
        ValueError: A line is not JSON or lacks the answer; the message names file and line.
    """
    path = Path(path)
    cache_file = None
    if cache_dir is not None:
        cache_file = Path(cache_dir) / f"{path.stem}-{_cache_key(path, tokenizer, settings)}.npz"
        if cache_file.is_file():
            try:
                with np.load(cache_file) as data:
                    return TokenizedExamples(data["tokens"], data["loss_flags"], data["offsets"])
            except (OSError, ValueError, KeyError) as exc:
                logger.warning("SFT cache %s is unreadable (%s); tokenizing again", cache_file, exc)
    examples = _tokenize_file(path, tokenizer, settings, workers)
    if cache_file is not None:
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(cache_file, lambda handle: np.savez(handle, **vars(examples)))
        except OSError as exc:
            logger.warning("SFT cache not written to %s: %s", cache_file.parent, exc)
    return examples


def epoch_order(count: int, shuffle_seed: int | None, epoch: int) -> np.ndarray:
    """The order of ``count`` examples in ``epoch``: shuffled with ``seed + epoch``, or file
    order when ``shuffle_seed`` is ``None``."""
    if shuffle_seed is None:
        return np.arange(count, dtype=np.int64)
    return np.random.default_rng(int(shuffle_seed) + epoch).permutation(count)


def pad_id(tokenizer: Tokenizer) -> int:
    """The tokenizer's pad id, or its end-of-document id when it has none."""
    pad = int(getattr(tokenizer, "pad", -1))
    return pad if pad >= 0 else int(tokenizer.eod)


class SFTDataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Map-style dataset of SFT samples in the trainer's GPT batch format.

    ``dataset[i]`` is ``{"tokens", "labels", "loss_mask", "position_ids"}``, each of
    ``seq_length`` entries; ``loss_mask`` is 1 exactly on answer labels.

    Args:
        examples: Tokenized records.
        seq_length: Tokens per sample.
        pad_token: Id used for padding.
        truncation: ``"left"``, ``"right"`` or ``"drop"``.
        num_samples: Length of the dataset (whole epochs over the examples, at least one).
        shuffle_seed: Shuffle each epoch with ``seed + epoch``; ``None`` keeps file order.
        name: Split name for log lines.

    Raises:
        ValueError: No example fits (all skipped).
    """

    _label = "SFT"

    def __init__(
        self,
        examples: TokenizedExamples,
        seq_length: int,
        pad_token: int,
        truncation: str = "left",
        *,
        num_samples: int = 0,
        shuffle_seed: int | None = None,
        name: str = "train",
    ) -> None:
        self.seq_length = int(seq_length)
        self.pad_token = int(pad_token)
        self.examples, self.skipped = fit_examples(
            examples, self.seq_length, truncation, f"{self._label} {name} split"
        )
        self._arrange(num_samples, shuffle_seed)

    def _arrange(self, num_samples: int, shuffle_seed: int | None) -> None:
        count = len(self.examples)
        epochs = max(1, math.ceil(num_samples / count))
        self._order = np.concatenate([epoch_order(count, shuffle_seed, e) for e in range(epochs)])

    def __len__(self) -> int:
        return len(self._order)

    def example_index(self, index: int) -> int:
        """Which kept example sample ``index`` holds."""
        return int(self._order[index])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, flags = self.examples[self.example_index(index)]
        return build_sample([(ids, flags)], self.seq_length, self.pad_token, packed=False)


def fit_examples(
    examples: TokenizedExamples, seq_length: int, truncation: str, label: str
) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """Every example cut to ``seq_length`` positions (``seq_length + 1`` ids) by
    ``truncation``, or skipped: under ``"drop"`` when too long, and under any policy when no
    answer token is left after cutting (its sample would carry no loss).

    Returns:
        ``(kept examples, number skipped)``; skips are logged once, naming ``label``.

    Raises:
        ValueError: No example fits.
    """
    kept: list[tuple[np.ndarray, np.ndarray]] = []
    most = seq_length + 1
    for index in range(len(examples)):
        ids, flags = examples.example(index)
        if len(ids) > most:
            if truncation == "drop":
                continue
            cut = slice(-most, None) if truncation == "left" else slice(most)
            ids, flags = ids[cut], flags[cut]
        # flags[0] never reaches a label (labels are ids[1:]).
        if flags[1:].any():
            kept.append((ids, flags))
    skipped = len(examples) - len(kept)
    if skipped:
        logger.warning(
            "%s: %d of %d examples skipped (too long with truncation=%r, or no answer token left)",
            label,
            skipped,
            len(examples),
            truncation,
        )
    if not kept:
        raise ValueError(f"{label}: no example fits seq_length {seq_length}")
    return kept, skipped


def build_sample(
    parts: Sequence[tuple[np.ndarray, np.ndarray]],
    seq_length: int,
    pad_token: int,
    *,
    packed: bool,
) -> dict[str, torch.Tensor]:
    """One sample of ``seq_length`` tokens from one or several examples placed end to end.

    Each example of ``n`` ids contributes ``n - 1`` positions (inputs ``ids[:-1]``, labels
    ``ids[1:]``), positions restarting at 0. With ``packed``, the sample also holds
    ``attention_mask`` (``[1, s, s]``, ``True`` = masked) confining attention to each
    example (block-diagonal causal) and ``cu_seqlens`` (example boundaries, padded with
    the total length to ``seq_length + 1`` entries so batches collate).
    """
    tokens = np.full(seq_length, pad_token, dtype=np.int64)
    labels = np.full(seq_length, pad_token, dtype=np.int64)
    loss_mask = np.zeros(seq_length, dtype=np.float32)
    position_ids = np.arange(seq_length, dtype=np.int64)
    segment = np.full(seq_length, -1, dtype=np.int64)
    start = 0
    bounds = [0]
    for number, (ids, flags) in enumerate(parts):
        length = len(ids) - 1
        if start + length > seq_length:
            raise ValueError(f"examples of {start + length} tokens exceed seq_length {seq_length}")
        tokens[start : start + length] = ids[:-1]
        labels[start : start + length] = ids[1:]
        loss_mask[start : start + length] = flags[1:]
        position_ids[start : start + length] = np.arange(length)
        segment[start : start + length] = number
        start += length
        bounds.append(start)
    sample = {
        "tokens": torch.from_numpy(tokens),
        "labels": torch.from_numpy(labels),
        "loss_mask": torch.from_numpy(loss_mask),
        "position_ids": torch.from_numpy(position_ids),
    }
    if packed:
        # Padding is its own segment so its rows still attend to something (no NaN rows).
        seg = torch.from_numpy(np.where(segment < 0, len(parts), segment))
        causal = torch.ones(seq_length, seq_length, dtype=torch.bool).tril()
        allowed = (seg[:, None] == seg[None, :]) & causal
        sample["attention_mask"] = (~allowed).unsqueeze(0)
        cu = np.full(seq_length + 1, start, dtype=np.int32)
        cu[: len(bounds)] = bounds
        sample["cu_seqlens"] = torch.from_numpy(cu)
    return sample


def build_sft_datasets(
    dataset_config: FinetuningDatasetConfig, tokenizer: Tokenizer, num_samples: tuple[int, int, int]
) -> tuple[Any, Any, Any]:
    """Train, validation and test datasets of a ``FinetuningDatasetConfig``.

    Packed datasets (``packed_sequence_specs.packed_sequence_size > 0``) come from
    :mod:`bridge.train.data.packing`.

    Args:
        dataset_config: ``FinetuningDatasetConfig`` (checked by
            :func:`check_finetuning_dataset`).
        tokenizer: The run's tokenizer.
        num_samples: ``(train, valid, test)`` samples the run draws.

    Returns:
        ``(train_ds, valid_ds, test_ds)``; ``None`` for a split not asked for.
    """
    check_finetuning_dataset(dataset_config)
    settings = sft_settings(dataset_config.dataset_kwargs)
    assert dataset_config.dataset_root is not None  # checked above
    root = Path(dataset_config.dataset_root)
    cache_dir = Path(settings.cache_dir) if settings.cache_dir else root / ".sft_cache"
    specs = dataset_config.packed_sequence_specs
    packed = specs is not None and (specs.packed_sequence_size or 0) > 0
    out: list[Any] = []
    for split, ((_, path), wanted) in enumerate(
        zip(_split_paths(dataset_config), num_samples, strict=True)
    ):
        if path is None:
            out.append(None)
            continue
        examples = load_tokenized_examples(
            path,
            tokenizer,
            settings,
            cache_dir=cache_dir,
            workers=int(dataset_config.memmap_workers),
        )
        if split == 0 and dataset_config.max_train_samples is not None:
            examples = examples.head(int(dataset_config.max_train_samples))
        common: dict[str, Any] = {
            "num_samples": int(wanted),
            "shuffle_seed": int(dataset_config.seed) if split == 0 else None,
            "name": SFT_SPLIT_FILES[split].removesuffix(".jsonl"),
        }
        dataset_class: type[Any] = SFTDataset
        if packed:
            from bridge.train.data.packing import PackedSFTDataset

            assert specs is not None
            dataset_class, size = PackedSFTDataset, int(specs.packed_sequence_size)
            common["pad_cu_seqlens"] = bool(specs.pad_cu_seqlens)
        else:
            assert dataset_config.seq_length is not None  # validate() requires it
            size = int(dataset_config.seq_length)
        pad = pad_id(tokenizer)
        out.append(dataset_class(examples, size, pad, settings.truncation, **common))
    return out[0], out[1], out[2]
