"""Deterministic, resumable MIMO data loading: each rank gets its module's DP slice.

Every rank walks the same global sample order (a seeded permutation per epoch) and cuts it
the same way: step ``s`` takes samples ``[s * G, (s + 1) * G)`` of the order (``G`` the
global batch size), micro-batch ``k`` of the step takes ``M`` of those (``M`` the
micro-batch size), and data-parallel replica ``d`` of a module with DP size ``D`` takes
samples ``[d * M / D, (d + 1) * M / D)`` of each micro-batch. An encoder replica and the
language-model replica that own the same sample therefore load the same sample, which is
what the cross-module data path relies on. Resuming from ``consumed_samples`` continues the
same order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.utils.data import default_collate

from bridge.mimo.infra import MegatronMIMOInfra

__all__ = ["MapDataset", "MimoDataLoader"]


class MapDataset(Protocol):
    """A map-style dataset: ``len(ds)`` and ``ds[i]`` for ``0 <= i < len(ds)``."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


class MimoDataLoader:
    """Yields, per training step, this rank's slice of every micro-batch of a global batch.

    Iterating gives, for each step, a list of ``num_microbatches`` collated batches, each
    holding ``micro_batch_size / dp_size`` samples. Samples are dicts of tensors (nested
    dicts allowed, e.g. ``{"input_ids": ..., "labels": ..., "loss_mask": ...,
    "modality_inputs": {"vision": {"encoder": {"images": ...}}}}``).

    Args:
        dataset: Map-style dataset with at least ``global_batch_size`` samples.
        global_batch_size: Samples per step over all replicas.
        micro_batch_size: Samples per micro-batch over all replicas.
        dp_rank: This rank's data-parallel index in its module.
        dp_size: Its module's data-parallel size.
        seed: Seed of the per-epoch permutation.
        shuffle: Permute each epoch (else the dataset order).
        consumed_samples: Samples already consumed (resume point); a multiple of
            ``global_batch_size``.
        collate_fn: Turns a list of samples into a batch; default torch's ``default_collate``.

    Raises:
        ValueError: A size does not divide, the dataset is too small, or ``consumed_samples``
            is not at a step boundary.
    """

    def __init__(
        self,
        dataset: MapDataset,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int = 1234,
        shuffle: bool = True,
        consumed_samples: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        for label, value in (
            ("global_batch_size", global_batch_size),
            ("micro_batch_size", micro_batch_size),
            ("dp_size", dp_size),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{label} must be a positive integer, got {value!r}")
        if global_batch_size % micro_batch_size:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not a multiple of "
                f"micro_batch_size={micro_batch_size}"
            )
        if micro_batch_size % dp_size:
            raise ValueError(
                f"micro_batch_size={micro_batch_size} is not divisible by the data-parallel "
                f"size {dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
        size = len(dataset)
        if size < global_batch_size:
            raise ValueError(
                f"the dataset has {size} samples, fewer than global_batch_size={global_batch_size}"
            )
        if consumed_samples < 0 or consumed_samples % global_batch_size:
            raise ValueError(
                f"consumed_samples={consumed_samples} must be a non-negative multiple of "
                f"global_batch_size={global_batch_size} (resume at a step boundary)"
            )
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.consumed_samples = consumed_samples
        self.collate_fn = collate_fn or default_collate
        # Whole global batches per epoch: a batch never holds a sample twice.
        self._epoch_len = size // global_batch_size * global_batch_size
        self._perm_epoch = -1
        self._perm: list[int] = []

    @classmethod
    def for_infra(
        cls, dataset: MapDataset, infra: MegatronMIMOInfra, **kwargs: Any
    ) -> MimoDataLoader:
        """A loader for this rank: its module's ``dp_rank`` / ``dp_size`` come from ``infra``.

        Args:
            dataset: Map-style dataset.
            infra: The job's infra (colocated modules share one data-parallel layout).
            **kwargs: The remaining constructor arguments.
        """
        name = infra.participating_modules[0]
        return cls(dataset, dp_rank=infra.dp_rank(name), dp_size=infra.dp_size(name), **kwargs)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step."""
        return self.global_batch_size // self.micro_batch_size

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, self._epoch_len)
        if epoch != self._perm_epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed + epoch)
                self._perm = torch.randperm(len(self.dataset), generator=gen).tolist()
            else:
                self._perm = list(range(len(self.dataset)))
            self._perm_epoch = epoch
        return self._perm[offset]

    def step_indices(self, consumed_samples: int | None = None) -> list[list[int]]:
        """Dataset indices of every full (all-replica) micro-batch of the step that starts
        after ``consumed_samples`` samples (default: the loader's position)."""
        start = self.consumed_samples if consumed_samples is None else consumed_samples
        return [
            [
                self._index(start + k * self.micro_batch_size + i)
                for i in range(self.micro_batch_size)
            ]
            for k in range(self.num_microbatches)
        ]

    def local_indices(self, consumed_samples: int | None = None) -> list[list[int]]:
        """This replica's dataset indices of each micro-batch of the step."""
        per_replica = self.micro_batch_size // self.dp_size
        lo = self.dp_rank * per_replica
        return [mb[lo : lo + per_replica] for mb in self.step_indices(consumed_samples)]

    def __iter__(self) -> Iterator[list[Any]]:
        return self

    def __next__(self) -> list[Any]:
        """This rank's micro-batches of the next step; advances ``consumed_samples``."""
        batches = [
            self.collate_fn([self.dataset[i] for i in indices]) for indices in self.local_indices()
        ]
        self.consumed_samples += self.global_batch_size
        return batches

    def state_dict(self) -> dict[str, int]:
        """The resume position (and the order's seed, checked on load)."""
        return {"consumed_samples": self.consumed_samples, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a :meth:`state_dict`.

        Raises:
            ValueError: The state was saved with another seed or at a non-step boundary.
        """
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(
                f"data loader state was saved with seed={state['seed']} but this loader has "
                f"seed={self.seed}; the sample order would differ"
            )
        consumed = int(state["consumed_samples"])
        if consumed < 0 or consumed % self.global_batch_size:
            raise ValueError(
                f"consumed_samples={consumed} is not a multiple of global_batch_size="
                f"{self.global_batch_size}"
            )
        self.consumed_samples = consumed
