"""Separate validation sets (``dataset.multiple_validation_sets``) and their full pass
(``dataset.full_validation``).

With ``multiple_validation_sets``, the validation data is not blended: megatron-core's
``BlendedMegatronDatasetBuilder`` builds one dataset per prefix of
``dataset.blend_per_split``'s validation entry (a list where it would otherwise build one
``BlendedDataset``); for ``dataset.blend`` with a ``split``, whose validation split
megatron-core blends regardless, each prefix's validation split is built alone
(:func:`bridge.train.data.datasets.build_train_valid_test_datasets`). Each set is
evaluated on its own and logged under its own name: the prefix's file name
(``validation <name>``, e.g. the TensorBoard / W&B tag ``lm loss validation wiki``), or its
position in the blend (``validation 0``, ``validation 1``, ...) when two prefixes share a
file name.

Without ``full_validation``, every evaluation reads ``train.eval_iters`` global batches of
each set, continuing where the previous evaluation of that set stopped. Every set advances
by the same number of samples, so the one checkpointed counter
(``TrainState.consumed_valid_samples``) is each set's position: a resumed run positions
every set's sampler at it and reads what the interrupted run would have read next.

With ``full_validation``, megatron-core builds each validation set as one pass over its
documents (no sample count), and every evaluation reads all of it from its first sample:
``ceil(len(set) / train.global_batch_size)`` global batches, the last one filled up with
loss-free samples, so every sample counts exactly once (Megatron-LM's full validation
also evaluates every sample; Megatron-Bridge refuses the field). A pass always starts at
sample 0, so it has no position to save: ``consumed_valid_samples`` does not advance.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = ["ValidationDatasets", "ValidationSet", "ValidationSets", "validation_set_names"]


def validation_set_names(prefixes: Sequence[str]) -> tuple[str, ...]:
    """Each validation prefix's name: its file name, or its index when file names repeat."""
    names = [Path(prefix).name for prefix in prefixes]
    if len(set(names)) == len(names) and all(names):
        return tuple(names)
    return tuple(str(index) for index in range(len(prefixes)))


@dataclass(frozen=True)
class ValidationDatasets:
    """The validation split as separate datasets, as the data builder returns it.

    Attributes:
        names: One name per dataset (:func:`validation_set_names`).
        datasets: megatron datasets, in the order of the validation blend.
        full_pass: ``dataset.full_validation``: each dataset is one pass over its documents.
    """

    names: tuple[str, ...]
    datasets: tuple[Any, ...]
    full_pass: bool = False

    def __post_init__(self) -> None:
        if len(self.names) != len(self.datasets) or not self.datasets:
            raise ValueError(
                f"ValidationDatasets: {len(self.names)} names for {len(self.datasets)} datasets"
            )


@dataclass
class ValidationSet:
    """One validation set as the evaluation reads it.

    Attributes:
        name: The set's name (the logged split is ``validation <name>``).
        loader: Its data loader (a re-iterable of micro-batches).
        iterations: Global batches of one full pass (``full_validation``), or ``None`` to
            read ``train.eval_iters`` global batches per evaluation, continuing.
        continuing: Builds the continuing iterator from ``loader`` (used once, without
            ``iterations``).
        wrap: Wraps every iterator handed out (megatron's ``RerunDataIterator``).
    """

    name: str
    loader: Iterable[Any]
    iterations: int | None = None
    continuing: Callable[[Iterable[Any]], Iterator[Any]] = iter
    wrap: Callable[[Iterator[Any]], Any] | None = None
    _iterator: Any = field(default=None, init=False, repr=False)

    def batches(self) -> Any:
        """The iterator this evaluation of the set reads: a fresh pass from the set's first
        sample with ``iterations``, else the one iterator every evaluation continues."""
        wrap = self.wrap or (lambda iterator: iterator)
        if self.iterations is not None:
            return wrap(iter(self.loader))
        if self._iterator is None:
            self._iterator = wrap(self.continuing(self.loader))
        return self._iterator


@dataclass(frozen=True)
class ValidationSets:
    """The separate validation sets the evaluation reads, in the order of the blend.

    Attributes:
        sets: One :class:`ValidationSet` per dataset.
        full_pass: ``dataset.full_validation``.
    """

    sets: tuple[ValidationSet, ...]
    full_pass: bool = False

    def __iter__(self) -> Iterator[ValidationSet]:
        return iter(self.sets)

    def __len__(self) -> int:
        return len(self.sets)

    def wrapped(self, wrap: Callable[[Iterator[Any]], Any]) -> ValidationSets:
        """The same sets, with every iterator they hand out wrapped by ``wrap``."""
        return ValidationSets(tuple(replace(s, wrap=wrap) for s in self.sets), self.full_pass)
