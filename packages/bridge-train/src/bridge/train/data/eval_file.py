"""One file as an evaluation dataset (``bridge-train --eval-only --eval-data FILE``).

* ``*.jsonl`` with supervised-finetuning records (prompt/answer, or chat ``messages``): one
  sample per record, loss on the answer tokens only, exactly as the SFT validation split
  makes them (:class:`bridge.train.data.sft.SFTDataset`, the run's ``dataset_kwargs`` when
  its dataset is a finetuning one).
* ``*.jsonl`` with ``{"text": ...}`` records: the documents, each followed by the
  end-of-document token, cut into consecutive windows of ``seq_length`` tokens; loss on
  every token (as pretraining data).
* any other file: its whole text as one document, cut the same way.

Every token is evaluated once: the last window is padded, and :class:`WholeBatches` pads the
dataset to whole global batches with samples whose loss mask is zero, so the reported
loss is the token average over exactly the file's tokens.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bridge.train.data.preprocess import jsonl_records
from bridge.train.data.sft import (
    SFTDataset,
    build_sample,
    load_tokenized_examples,
    pad_id,
    sft_settings,
)
from bridge.train.data.tokenizers import Tokenizer

__all__ = ["TokenWindows", "WholeBatches", "build_eval_file_dataset"]


class TokenWindows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """A token stream as consecutive samples of ``seq_length`` positions (loss everywhere).

    Sample ``i`` predicts tokens ``i * seq_length + 1 .. (i + 1) * seq_length`` from the ones
    before them; the last sample is padded (padding carries no loss).

    Args:
        tokens: The token ids.
        seq_length: Positions per sample.
        pad_token: Id used for padding.
    """

    def __init__(self, tokens: np.ndarray, seq_length: int, pad_token: int) -> None:
        if len(tokens) < 2:
            raise ValueError("the evaluation data has fewer than 2 tokens: nothing to predict")
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.seq_length = int(seq_length)
        self.pad_token = int(pad_token)

    def __len__(self) -> int:
        return math.ceil((len(self.tokens) - 1) / self.seq_length)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:

        start = index * self.seq_length
        ids = self.tokens[start : start + self.seq_length + 1]
        flags = np.ones(len(ids), dtype=np.uint8)
        return build_sample([(ids, flags)], self.seq_length, self.pad_token, packed=False)


class WholeBatches(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """``dataset`` padded to a multiple of ``batch`` samples with loss-free samples.

    Args:
        dataset: A map-style dataset of GPT batch dicts (``loss_mask`` included).
        batch: The global batch size.
    """

    def __init__(self, dataset: Any, batch: int) -> None:
        self.dataset = dataset
        self.real = len(dataset)
        self._length = math.ceil(self.real / int(batch)) * int(batch)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index < self.real:
            return dict(self.dataset[index])
        sample = dict(self.dataset[0])
        sample["loss_mask"] = torch.zeros_like(sample["loss_mask"])
        return sample


def _text_documents(path: Path, tokenizer: Tokenizer) -> np.ndarray:
    ids: list[int] = []
    for number, record, _ in jsonl_records(path):
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ValueError(f"{path} line {number}: needs a 'text' string like line 1")
        ids += [*tokenizer.tokenize(text), int(tokenizer.eod)]
    return np.asarray(ids, dtype=np.int64)


def build_eval_file_dataset(
    path: str | os.PathLike[str],
    tokenizer: Tokenizer,
    seq_length: int,
    *,
    dataset_kwargs: dict[str, Any] | None = None,
) -> Any:
    """The evaluation dataset of ``path`` (see the module docstring).

    Args:
        path: The file.
        tokenizer: The model's tokenizer.
        seq_length: Positions per sample (the model's ``seq_length``).
        dataset_kwargs: SFT rendering settings (``prompt_key``, ``answer_key``,
            ``prompt_template``, ``truncation``, ...), as a finetuning dataset section has.

    Returns:
        A map-style dataset of GPT batch dicts.

    Raises:
        ValueError: The file cannot be read, is empty, or its records are neither SFT
            records nor ``{"text": ...}`` documents.
    """

    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--eval-data {file} does not exist")
    pad = pad_id(tokenizer)
    if file.suffix != ".jsonl":
        text = file.read_text(encoding="utf-8")
        ids = np.asarray([*tokenizer.tokenize(text), int(tokenizer.eod)], dtype=np.int64)
        return TokenWindows(ids, seq_length, pad)
    first = next(jsonl_records(file), None)
    if first is None:
        raise ValueError(f"{file} holds no record")
    record = first[1]
    settings = sft_settings(dataset_kwargs)
    if isinstance(record, dict) and ("messages" in record or settings.answer_key in record):
        examples = load_tokenized_examples(file, tokenizer, settings)
        return SFTDataset(examples, seq_length, pad, settings.truncation, name=file.name)
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return TokenWindows(_text_documents(file, tokenizer), seq_length, pad)
    raise ValueError(
        f"{file} line 1: expected an SFT record ({settings.prompt_key!r}/"
        f"{settings.answer_key!r} or 'messages') or a {{'text': ...}} document"
    )
