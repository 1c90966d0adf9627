"""Swapping in SFT data by field overrides, with defaults that fit the machine.

Finetuning a converted model meant replacing its run config's dataset section whole
(``dataset={_target_: ...}``): a field override failed on the old class's fields, and the
printed override diff grew to 43 ``<unset>`` lines. The reference's dataloader defaults
(8 workers) made torch warn on a 2-core machine.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from bridge.train.cli import run
from bridge.train.data import loaders

SFT_DATA = Path(__file__).resolve().parents[3] / "examples" / "data" / "sft_addition"


def test_sft_data_by_field_overrides_with_a_short_diff(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--dry-run",
        "dataset._target_=bridge.config.FinetuningDatasetConfig",
        f"dataset.dataset_root={SFT_DATA}",
        "dataset.seq_length=${model.seq_length}",
        "train.train_iters=3",
    ]
    assert run(argv) == 0
    out = capsys.readouterr().out
    diff = out.split("overrides (recipe -> this run):\n")[1].split("[bridge-train]")[0]
    lines = diff.splitlines()
    assert "<unset>" not in diff, diff
    assert lines[0].startswith(
        "  dataset._target_: 'bridge.config.MockGPTDatasetConfig' -> "
        "'bridge.config.FinetuningDatasetConfig' ("
    )
    assert "fields of the recipe's class left out)" in lines[0]
    assert f"  dataset.dataset_root: <default None> -> '{SFT_DATA}'" in lines
    assert "  dataset.seq_length: <default None> -> 128" in lines
    assert len(lines) <= 10, lines  # the class, its two fields, the length and its schedule


def test_more_workers_than_cpus_are_capped_without_torch_warning() -> None:
    usable = loaders._usable_cpus()
    # Only the fields the loaders read (a whole dataset section needs its data files).
    config: Any = SimpleNamespace(num_workers=usable + 6, pin_memory=True, dataloader_type="single")
    train: Any = SimpleNamespace(micro_batch_size=2, train_iters=1, eval_iters=0)
    state = SimpleNamespace(consumed_train_samples=0, consumed_valid_samples=0)
    dataset = torch.utils.data.TensorDataset(torch.arange(8))
    train_loader, _, _ = loaders.build_train_valid_test_data_loaders(
        (dataset, None, None),
        config,
        train,
        state,
        data_parallel_rank=0,
        data_parallel_size=1,
    )
    assert train_loader is not None and train_loader.num_workers == usable
    assert train_loader.pin_memory == torch.cuda.is_available()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_loader.check_worker_number_rationality()
    assert not caught, [str(w.message) for w in caught]


def test_loader_workers_get_the_exit_signal_guard_and_external_data_passes_through() -> None:
    from bridge.resiliency import DataloaderSignalGuard

    config: Any = SimpleNamespace(num_workers=1, dataloader_type="single")
    train: Any = SimpleNamespace(
        micro_batch_size=2, train_iters=1, eval_iters=0, exit_signal_handler_for_dataloader=True
    )
    state: Any = SimpleNamespace(consumed_train_samples=0, consumed_valid_samples=0)
    dataset = torch.utils.data.TensorDataset(torch.arange(8))
    datasets = (dataset, None, None)
    layout = {"data_parallel_rank": 0, "data_parallel_size": 1}
    loader, _, _ = loaders.build_train_valid_test_data_loaders(
        datasets, config, train, state, **layout
    )
    assert loader is not None and isinstance(loader.worker_init_fn, DataloaderSignalGuard)
    # "external": the datasets are the iterables of batches, handed back as they are.
    config.dataloader_type = "external"
    assert loaders.build_train_valid_test_data_loaders(datasets, config, train, state) == datasets
    assert state.do_train and not state.do_valid
