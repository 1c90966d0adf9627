"""Deterministic, data-parallel-sharded, resumable batch samplers.

Both samplers define one *global* order of sample indices that does not depend on the
data-parallel size, and cut it into chunks of ``micro_batch_size x data_parallel_size``
samples; data-parallel rank ``r`` takes the ``r``-th ``micro_batch_size`` slice of each
chunk. A global batch of ``B`` samples therefore is the same set of samples (stream
positions ``[k B, (k + 1) B)``) whatever the data-parallel size and micro-batch size, and
resuming from ``consumed_samples`` (counted over all ranks) continues the stream exactly.

* :class:`PretrainingSampler` (``dataloader_type="single"``): the stream is
  ``0, 1, ..., total - 1`` once (megatron's GPT datasets are already shuffled);
* :class:`CyclicRandomSampler` (``dataloader_type="cyclic"``): the stream is an endless
  sequence of epochs, each a permutation of the dataset drawn from ``seed + epoch``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["CyclicRandomSampler", "PretrainingSampler"]


@dataclass
class _DataParallelSampler:
    """A position in the global stream and this rank's slice of each chunk of it."""

    total_samples: int
    consumed_samples: int
    micro_batch_size: int
    data_parallel_rank: int
    data_parallel_size: int

    def __post_init__(self) -> None:
        rank, size = self.data_parallel_rank, self.data_parallel_size
        if self.total_samples <= 0:
            raise ValueError(f"the dataset has no samples (total_samples={self.total_samples})")
        if self.consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {self.consumed_samples}")
        if self.micro_batch_size <= 0:
            raise ValueError(f"train.micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if size <= 0 or not 0 <= rank < size:
            raise ValueError(f"data_parallel_rank={rank} is not in [0, data_parallel_size={size})")
        self.chunk = self.micro_batch_size * size
        self.start = rank * self.micro_batch_size


@dataclass
class PretrainingSampler(_DataParallelSampler):
    """One sequential pass over the dataset, sharded over data-parallel ranks.

    Args:
        total_samples: Dataset length.
        consumed_samples: Samples (over all ranks) already consumed; iteration resumes there.
        micro_batch_size: Samples per rank per micro-batch.
        data_parallel_rank: This rank's data-parallel index.
        data_parallel_size: Number of data-parallel ranks.
        drop_last: Drop a final chunk smaller than ``micro_batch_size x data_parallel_size``
            (otherwise it is split as evenly as possible; a rank may get fewer samples).

    Raises:
        ValueError: A size or rank is out of range.
    """

    drop_last: bool = True

    def __len__(self) -> int:
        """Micro-batches this rank yields from ``consumed_samples`` to the end."""
        remaining = max(self.total_samples - self.consumed_samples, 0)
        full, rest = divmod(remaining, self.chunk)
        if rest and not self.drop_last:
            full += int(self.start < rest)
        return full

    def __iter__(self) -> Iterator[list[int]]:
        """Yield this rank's index list of every micro-batch, in stream order."""
        stream = range(self.consumed_samples, self.total_samples)
        for chunk in itertools.batched(stream, self.chunk):
            if len(chunk) < self.chunk and self.drop_last:
                return
            if indices := list(chunk[self.start : self.start + self.micro_batch_size]):
                yield indices


@dataclass
class CyclicRandomSampler(_DataParallelSampler):
    """Endless shuffled epochs over the dataset, sharded over data-parallel ranks.

    Epoch ``e`` is ``torch.randperm(total_samples)`` drawn from a generator seeded with
    ``seed + e``; the global stream is the concatenation of the epochs.

    Args:
        total_samples, consumed_samples, micro_batch_size, data_parallel_rank,
            data_parallel_size: As for :class:`PretrainingSampler`.
        seed: Base seed of the epoch permutations.

    Raises:
        ValueError: A size or rank is out of range.
    """

    seed: int = 0

    def _epoch(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.total_samples, generator=generator).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        """Yield this rank's index list of every micro-batch, forever."""
        epoch, offset = divmod(self.consumed_samples, self.total_samples)
        later = itertools.chain.from_iterable(map(self._epoch, itertools.count(epoch + 1)))
        stream = itertools.chain(self._epoch(epoch)[offset:], later)
        for chunk in itertools.batched(stream, self.chunk):
            yield list(chunk[self.start : self.start + self.micro_batch_size])
