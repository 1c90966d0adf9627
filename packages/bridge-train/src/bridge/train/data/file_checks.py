"""Checks of ``.bin`` / ``.idx`` dataset files before training (truncation, garbage, token ids).

megatron-core's ``IndexedDataset`` memory-maps both files and trusts them: a truncated
``.bin`` fails (or reads garbage) only when a sample past its end is drawn, a garbage
``.idx`` ends in an ``AssertionError`` or a NumPy error, and token ids beyond the
vocabulary reach the embedding as an index error hours into a run. These checks read the
index (header, sequence lengths and pointers: a few bytes per document), compare the data
file's size with what the index describes, and take the largest token id of the data file,
vectorised with NumPy over a memory map (about 1-2 GB/s from the page cache).

The index format is megatron-core's (``megatron/core/datasets/indexed_dataset.py``): the
9-byte header ``MMIDIDX\\x00\\x00``, version 1 (u64), the token dtype code (u8, megatron's
``DType``), sequence and document counts (u64 each), then int32 lengths, int64 byte pointers
and int64 document indices.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
from megatron.core.datasets.indexed_dataset import DType

__all__ = ["DataFileError", "check_indexed_dataset", "read_sequence_lengths"]

_INDEX_HEADER = b"MMIDIDX\x00\x00"
_REBUILD = "re-run bridge-preprocess-data to write it again"
# Tokens per chunk of the max scan (bounded memory for any file size).
_SCAN_CHUNK = 1 << 25


class DataFileError(ValueError):
    """A dataset file is damaged or does not fit the configuration; the message says which."""


def _read_index(idx: Path) -> tuple[type[np.number], np.ndarray, np.ndarray]:
    """Token dtype, sequence lengths and byte pointers of ``idx``."""
    size = idx.stat().st_size
    with open(idx, "rb") as handle:
        head = handle.read(34)
    if len(head) < 34 or head[:9] != _INDEX_HEADER:
        raise DataFileError(
            f"{idx} is not a megatron index file (bad header: empty, truncated or another "
            f"format); {_REBUILD}"
        )
    version, code, sequences, documents = struct.unpack("<QBQQ", head[9:34])
    if version != 1 or code not in [member.value for member in DType]:
        raise DataFileError(
            f"{idx} has an unknown index version {version} or token type {code}; {_REBUILD}"
        )
    needed = 34 + sequences * (4 + 8) + documents * 8
    if size < needed:
        raise DataFileError(
            f"{idx} is truncated ({size} bytes; its header describes {sequences} sequences "
            f"and {documents} documents, {needed} bytes); {_REBUILD}"
        )
    index = np.memmap(idx, mode="r", dtype=np.uint8)
    lengths = np.frombuffer(index, dtype=np.int32, count=sequences, offset=34)
    pointers = np.frombuffer(index, dtype=np.int64, count=sequences, offset=34 + 4 * sequences)
    return DType.dtype_from_code(code), lengths, pointers


def read_sequence_lengths(prefix: str | os.PathLike[str]) -> np.ndarray:
    """The token count of every sequence (document) of ``<prefix>.idx``, memory-mapped.

    Raises:
        DataFileError: The index is garbage or truncated.
    """
    return _read_index(Path(f"{prefix}.idx"))[1]


def check_indexed_dataset(
    prefix: str | os.PathLike[str], vocab_size: int | None, field: str = "dataset.blend"
) -> None:
    """Check the ``.idx`` / ``.bin`` pair of ``prefix`` and its token ids.

    Args:
        prefix: The dataset path prefix (without extension).
        vocab_size: Token ids must be below it (``None``: not checked).
        field: The config field naming the prefix (for the message).

    Raises:
        DataFileError: The index is garbage or truncated, the data file's size differs
            from what the index describes, or a token id is negative or ``>= vocab_size``.
    """
    idx, bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    dtype, lengths, pointers = _read_index(idx)
    itemsize = np.dtype(dtype).itemsize
    expected = int(pointers[-1]) + int(lengths[-1]) * itemsize if len(lengths) else 0
    actual = bin_path.stat().st_size
    if actual != expected:
        what = "truncated" if actual < expected else "longer than its index describes"
        raise DataFileError(
            f"{bin_path} is {what} ({actual} bytes, its index {idx.name} describes "
            f"{expected}); the pair was not written together or was damaged: {_REBUILD}"
        )
    if vocab_size is None or actual == 0 or not np.issubdtype(dtype, np.integer):
        return
    tokens = np.memmap(bin_path, mode="r", dtype=dtype)
    top, bottom = 0, 0
    for start in range(0, len(tokens), _SCAN_CHUNK):
        chunk = tokens[start : start + _SCAN_CHUNK]
        top = max(top, int(chunk.max()))
        bottom = min(bottom, int(chunk.min()))
    if top >= vocab_size or bottom < 0:
        bad = top if top >= vocab_size else bottom
        raise DataFileError(
            f"{bin_path} ({field}) holds token id {bad}, outside the vocabulary of "
            f"{vocab_size} (ids 0..{vocab_size - 1}): it was tokenized with another "
            "tokenizer; set tokenizer.vocab_size (or the tokenizer) to the one used by "
            f"bridge-preprocess-data, or {_REBUILD} with this tokenizer"
        )
