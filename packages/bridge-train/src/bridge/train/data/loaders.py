"""Data loaders and iterators for the train, validation and test splits.

``dataloader_type`` (``dataset.dataloader_type``, default ``"single"``):

* ``"single"``: the training iterator makes one pass over the training samples
  (:class:`~bridge.train.data.samplers.PretrainingSampler`); validation and test iterators
  restart at the end of their split, so evaluation can run any number of times;
* ``"cyclic"``: every split is an endless sequence of shuffled epochs
  (:class:`~bridge.train.data.samplers.CyclicRandomSampler`);
* ``"external"``: the "datasets" are already iterables of batches and are iterated as they
  are.

All iterators are positioned by the run's :class:`~bridge.train.TrainState`
(``consumed_train_samples`` / ``consumed_valid_samples``), so a resumed run reads exactly
the samples the interrupted one would have read next.

Separate validation sets (``dataset.multiple_validation_sets``) give a
:class:`~bridge.train.data.validation_sets.ValidationSets` in the validation slot: one
loader per set, each handing out its own iterator (see that module for the full pass).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from bridge.config import FinetuningDatasetConfig, GPTDatasetConfig, TrainingConfig
from bridge.train.data.eval_file import WholeBatches
from bridge.train.data.samplers import CyclicRandomSampler, PretrainingSampler
from bridge.train.data.validation_sets import ValidationDatasets, ValidationSet, ValidationSets

__all__ = [
    "build_data_loader",
    "build_train_valid_test_data_iterators",
    "build_train_valid_test_data_loaders",
    "cyclic_iter",
]


def cyclic_iter(iterable: Iterable[Any]) -> Iterator[Any]:
    """Iterate over ``iterable`` again and again (a new pass each time it is exhausted)."""
    while True:
        yielded = False
        for item in iterable:
            yielded = True
            yield item
        if not yielded:
            raise ValueError("cyclic_iter: the iterable is empty")


def build_data_loader(
    dataset: Any,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    *,
    dataloader_type: str = "single",
    num_workers: int = 0,
    pin_memory: bool = False,
    persistent_workers: bool = False,
    seed: int = 0,
    drop_last: bool = True,
    worker_init_fn: Callable[[int], Any] | None = None,
) -> DataLoader[Any] | None:
    """A ``DataLoader`` over ``dataset`` driven by one of this package's batch samplers.

    Args:
        dataset: A map-style dataset (``__len__`` / ``__getitem__``), or ``None``.
        consumed_samples: Samples of this split already consumed (over all ranks).
        micro_batch_size: Samples per rank per micro-batch.
        data_parallel_rank: This rank's data-parallel index.
        data_parallel_size: Number of data-parallel ranks.
        dataloader_type: ``"single"`` or ``"cyclic"``.
        num_workers: Worker processes (0 loads in this process).
        pin_memory: Pin batches in host memory (only used when CUDA is available).
        persistent_workers: Keep workers between passes (only with ``num_workers > 0``).
        seed: Shuffling seed for ``"cyclic"``.
        drop_last: Drop a final incomplete chunk (``"single"``).
        worker_init_fn: Called in each worker process when it starts.

    Returns:
        The loader, or ``None`` when ``dataset`` is ``None`` or empty.
    """
    if dataset is None or len(dataset) == 0:
        return None
    sampler: Any
    position = (
        len(dataset),
        consumed_samples,
        micro_batch_size,
        data_parallel_rank,
        data_parallel_size,
    )
    if dataloader_type == "single":
        sampler = PretrainingSampler(*position, drop_last=drop_last)
    elif dataloader_type == "cyclic":
        sampler = CyclicRandomSampler(*position, seed=seed)
    else:
        raise ValueError(
            f"build_data_loader: dataloader_type={dataloader_type!r} needs 'single' or 'cyclic'"
        )
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=bool(pin_memory and torch.cuda.is_available()),
        persistent_workers=bool(persistent_workers and num_workers > 0),
        worker_init_fn=worker_init_fn if num_workers > 0 else None,
        # Its own generator: a DataLoader iterator otherwise draws its workers' base seed from
        # torch's global generator, so building the iterators after a checkpoint's RNG state
        # was restored would shift dropout (and every other draw) against the uninterrupted run.
        generator=torch.Generator().manual_seed(int(seed)),
    )


logger = logging.getLogger(__name__)


def _usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, as torch's DataLoader counts them)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _worker_count(dataset_config: GPTDatasetConfig | FinetuningDatasetConfig) -> int:
    """``num_workers``, capped at the CPUs this process may use.

    The reference's default is 8 workers per loader; on a laptop or a 2-core CI machine
    torch warns about it ("suggested max number of worker ... is 2") and the extra processes
    only compete for the cores. Workers change where samples are loaded, never which.
    """
    wanted = int(getattr(dataset_config, "num_workers", 0) or 0)
    usable = _usable_cpus()
    if wanted <= usable:
        return wanted
    from core_utils.distributed import global_rank

    if global_rank() == 0:
        logger.info(
            "dataset.num_workers=%d is more than the %d CPUs this process may use: "
            "%d worker processes load each split",
            wanted,
            usable,
            usable,
        )
    return usable


def _worker_init_fn(train_config: TrainingConfig) -> Callable[[int], Any] | None:
    """Signal guard for DataLoader workers (``train.exit_signal_handler_for_dataloader``).

    Workers share the rank's process group, so a launcher's SIGTERM reaches them too; a
    worker dying of it would break the next batch before the exit checkpoint is saved.
    """
    if not getattr(train_config, "exit_signal_handler_for_dataloader", False):
        return None
    from bridge.resiliency import DataloaderSignalGuard

    return DataloaderSignalGuard(getattr(train_config, "exit_signal", signal.SIGTERM))


def build_train_valid_test_data_loaders(
    datasets: tuple[Any, Any, Any],
    dataset_config: GPTDatasetConfig | FinetuningDatasetConfig,
    train_config: TrainingConfig,
    train_state: Any,
    *,
    data_parallel_rank: int | None = None,
    data_parallel_size: int | None = None,
) -> tuple[Any, Any, Any]:
    """Loaders for the three splits, positioned at the train state's consumed samples.

    Args:
        datasets: ``(train_ds, valid_ds, test_ds)``; ``None`` entries give ``None`` loaders.
        dataset_config: The dataset config (``dataloader_type``, ``num_workers``,
            ``pin_memory``, ``persistent_workers``, ``random_seed``).
        train_config: ``TrainingConfig`` (``micro_batch_size``; with
            ``exit_signal_handler_for_dataloader`` the workers keep serving batches when the
            exit signal arrives, so the exit checkpoint can still be written).
        train_state: ``TrainState``; ``do_train`` / ``do_valid`` / ``do_test`` are set from
            which splits exist.
        data_parallel_rank: Defaults to megatron's data-parallel rank.
        data_parallel_size: Defaults to megatron's data-parallel size.

    Returns:
        ``(train_loader, valid_loader, test_loader)``; for ``"external"`` the datasets
        themselves; for separate validation sets a
        :class:`~bridge.train.data.validation_sets.ValidationSets` in the validation slot.

    Raises:
        ValueError: Unknown ``dataloader_type`` or missing ``micro_batch_size``.
    """
    # bridge-config's validate() refuses any other value; megatron's own configs have none.
    kind = getattr(dataset_config, "dataloader_type", None) or "single"
    train_ds, valid_ds, test_ds = datasets
    evaluates = int(getattr(train_config, "eval_iters", 0) or 0) > 0
    train_state.do_train = train_ds is not None and getattr(train_config, "train_iters", 1) != 0
    train_state.do_valid = valid_ds is not None and evaluates
    train_state.do_test = test_ds is not None and evaluates
    if kind == "external":
        return train_ds, valid_ds, test_ds
    mbs = getattr(train_config, "micro_batch_size", None)
    if not mbs:
        raise ValueError("train.micro_batch_size must be set to build data loaders")
    rank, size = data_parallel_rank, data_parallel_size
    if rank is None or size is None:
        from megatron.core import parallel_state

        built = parallel_state.model_parallel_is_initialized()
        rank = parallel_state.get_data_parallel_rank() if built else 0
        size = parallel_state.get_data_parallel_world_size() if built else 1
    common: dict[str, Any] = {
        "micro_batch_size": int(mbs),
        "data_parallel_rank": rank,
        "data_parallel_size": size,
        "dataloader_type": kind,
        "num_workers": _worker_count(dataset_config),
        "pin_memory": bool(getattr(dataset_config, "pin_memory", False)),
        "persistent_workers": bool(getattr(dataset_config, "persistent_workers", False)),
        # GPT configs name the seed random_seed, finetuning configs seed.
        "seed": int(
            getattr(dataset_config, "random_seed", None) or getattr(dataset_config, "seed", 0) or 0
        ),
        "worker_init_fn": _worker_init_fn(train_config),
    }
    train = build_data_loader(train_ds, train_state.consumed_train_samples, **common)
    valid: Any
    if isinstance(valid_ds, ValidationDatasets):
        valid = _validation_sets(valid_ds, train_config, train_state, common)
    else:
        valid = build_data_loader(valid_ds, train_state.consumed_valid_samples, **common)
    test = build_data_loader(test_ds, 0, **common)
    return train, valid, test


def _validation_sets(
    datasets: ValidationDatasets,
    train_config: TrainingConfig,
    train_state: Any,
    common: dict[str, Any],
) -> ValidationSets:
    """One loader per separate validation set (see :mod:`bridge.train.data.validation_sets`).

    A full pass reads each set in order from its first sample (``"single"`` whatever
    ``dataloader_type`` says: a shuffled epoch would be the same samples, and the
    ``"cyclic"`` sampler does not end where a pass does), its last global batch filled up
    with loss-free samples (:class:`~bridge.train.data.eval_file.WholeBatches`), so every
    sample counts once; otherwise each set's loader is positioned at the shared
    ``consumed_valid_samples`` and read on as the split would be.
    """
    kind = common["dataloader_type"]
    gbs = int(train_config.global_batch_size or 0) or int(common["micro_batch_size"]) * int(
        common["data_parallel_size"]
    )
    sets: list[ValidationSet] = []
    for name, dataset in zip(datasets.names, datasets.datasets, strict=True):
        if datasets.full_pass:
            whole = WholeBatches(dataset, gbs)
            loader = build_data_loader(whole, 0, **{**common, "dataloader_type": "single"})
            sets.append(ValidationSet(name, _present(loader), len(whole) // gbs))
        else:
            loader = build_data_loader(dataset, train_state.consumed_valid_samples, **common)
            sets.append(ValidationSet(name, _present(loader), continuing=_evaluation_iter(kind)))
    return ValidationSets(tuple(sets), full_pass=datasets.full_pass)


def _evaluation_iter(kind: str) -> Callable[[Iterable[Any]], Iterator[Any]]:
    # Under "single" an evaluated split (or validation set) restarts whenever it runs out.
    return cyclic_iter if kind == "single" else iter


def _present(loader: DataLoader[Any] | None) -> DataLoader[Any]:
    # build_data_loader gives None only for an empty dataset; megatron never builds an
    # empty validation set (split_checks refuses a prefix without a sample first).
    if loader is None:
        raise ValueError("a separate validation set holds no sample")
    return loader


def build_train_valid_test_data_iterators(
    datasets: tuple[Any, Any, Any],
    dataset_config: GPTDatasetConfig | FinetuningDatasetConfig,
    train_config: TrainingConfig,
    train_state: Any,
    *,
    data_parallel_rank: int | None = None,
    data_parallel_size: int | None = None,
) -> tuple[Iterator[Any] | None, Iterator[Any] | None, Iterator[Any] | None]:
    """Iterators over the three splits (see the module docstring for their behaviour).

    The arguments are :func:`build_train_valid_test_data_loaders`'.

    Returns:
        ``(train_iterator, valid_iterator, test_iterator)``, ``None`` for a missing split;
        separate validation sets stay a
        :class:`~bridge.train.data.validation_sets.ValidationSets`.
    """
    train, valid, test = build_train_valid_test_data_loaders(
        datasets,
        dataset_config,
        train_config,
        train_state,
        data_parallel_rank=data_parallel_rank,
        data_parallel_size=data_parallel_size,
    )
    evaluation = _evaluation_iter(getattr(dataset_config, "dataloader_type", None) or "single")
    # Separate validation sets stay as they are: each set hands out its own iterator.
    if valid is not None and not isinstance(valid, ValidationSets):
        valid = evaluation(valid)
    return (
        None if train is None else iter(train),
        valid,
        None if test is None else evaluation(test),
    )
