"""Build GPT datasets with megatron-core's ``BlendedMegatronDatasetBuilder``.

Mock configs give ``MockGPTDataset`` splits; real configs give ``GPTDataset`` over
``.bin`` / ``.idx`` files, with blends and train/validation/test splits. Every rank builds
the splits; megatron's builder lets global rank 0 build (and cache) the indices first while
the others wait at a barrier, then the others load them, so ``path_to_cache`` must be a
directory every rank sees. ``compile_helpers()`` is never called: the wheel's prebuilt
helper is used.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bridge.config import (
    FinetuningDatasetConfig,
    GPTDatasetConfig,
    TrainingConfig,
    convert_dataclass,
)
from bridge.train.data.tokenizers import Tokenizer
from bridge.train.data.validation_sets import ValidationDatasets, validation_set_names

if TYPE_CHECKING:  # megatron-core is imported where datasets are built
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.blended_megatron_dataset_config import (
        BlendedMegatronDatasetConfig,
    )

__all__ = [
    "build_gpt_dataset_config",
    "build_train_valid_test_datasets",
    "check_data_paths",
    "dataset_prefixes",
    "train_valid_test_num_samples",
]

_SPLIT_NAMES = ("train", "validation", "test")


def _as_blend(value: Any) -> tuple[list[str], list[float] | None] | None:
    if value is None:
        return None
    paths, weights = value
    return [str(p) for p in paths], None if weights is None else [float(w) for w in weights]


def dataset_prefixes(
    dataset_config: GPTDatasetConfig | FinetuningDatasetConfig,
) -> list[tuple[str, str]]:
    """``(field, prefix)`` for every dataset prefix of ``blend`` / ``blend_per_split``."""
    blends = [("dataset.blend", getattr(dataset_config, "blend", None))]
    per_split = getattr(dataset_config, "blend_per_split", None) or ()
    blends += [
        (f"dataset.blend_per_split[{n}]", b) for n, b in zip(_SPLIT_NAMES, per_split, strict=False)
    ]
    return [(field, str(p)) for field, blend in blends if blend is not None for p in blend[0]]


def check_data_paths(dataset_config: GPTDatasetConfig | FinetuningDatasetConfig) -> None:
    """Check that every dataset prefix of ``blend`` / ``blend_per_split`` has its files.

    Args:
        dataset_config: ``GPTDatasetConfig`` (bridge-config's or megatron's).

    Raises:
        FileNotFoundError: A prefix has no ``.bin`` or ``.idx``; the message names the
            field, the path and what to do.
    """
    for field, prefix in dataset_prefixes(dataset_config):
        missing = [ext for ext in (".bin", ".idx") if not Path(prefix + ext).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{field}: dataset {prefix!r} has no {' / '.join(prefix + m for m in missing)}; "
                "give the path prefix of a dataset written by bridge-preprocess-data (without "
                "the .bin/.idx extension)"
            )


def build_gpt_dataset_config(
    dataset_config: GPTDatasetConfig | FinetuningDatasetConfig,
    tokenizer: Tokenizer,
    megatron_class: type | None = None,
    **fields: Any,
) -> Any:
    """megatron-core's ``GPTDatasetConfig`` from bridge-config's, with ``tokenizer`` attached.

    Every init field of megatron's class is copied from ``dataset_config`` when it has it
    (bridge-config mirrors them field for field); blends become megatron's tuples.

    Args:
        dataset_config: bridge-config ``GPTDatasetConfig`` / ``MockGPTDatasetConfig`` (or
            megatron's own, returned with the tokenizer set).
        tokenizer: Tokenizer with ``vocab_size``, ``eod``, ``pad``, ``unique_identifiers``.
        megatron_class: Another megatron dataset config class to build (default
            ``GPTDatasetConfig``; T5 data builds ``T5MaskedWordPieceDatasetConfig``).
        **fields: Fields of ``megatron_class`` set explicitly.

    Returns:
        A megatron ``GPTDatasetConfig``.

    Raises:
        FileNotFoundError: A data path does not exist (see :func:`check_data_paths`).
    """
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    check_data_paths(dataset_config)
    if isinstance(dataset_config, GPTDatasetConfig):
        return dataclasses.replace(dataset_config, tokenizer=tokenizer)

    overrides: dict[str, Any] = {"tokenizer": tokenizer, **fields}
    overrides["blend"] = _as_blend(getattr(dataset_config, "blend", None))
    per_split = getattr(dataset_config, "blend_per_split", None)
    if per_split is not None:
        overrides["blend_per_split"] = [_as_blend(b) for b in per_split]
    if (
        overrides["blend"] is None
        and per_split is None
        and not getattr(dataset_config, "split", None)
    ):
        overrides["split"] = "1,1,1"
    return convert_dataclass(dataset_config, megatron_class or GPTDatasetConfig, **overrides)


def train_valid_test_num_samples(train_config: TrainingConfig) -> tuple[int, int, int]:
    """Samples needed per split, as megatron computes them.

    Training needs ``train_iters x global_batch_size`` (or ``train_samples``); validation
    runs ``eval_iters`` iterations every ``eval_interval`` plus once at the end; test runs
    ``eval_iters`` iterations once.

    Args:
        train_config: ``TrainingConfig``.

    Returns:
        ``(train, valid, test)`` sample counts.

    Raises:
        ValueError: Neither ``train_iters`` nor ``train_samples`` is set, or
            ``global_batch_size`` is missing.
    """
    gbs = getattr(train_config, "global_batch_size", None)
    if gbs is None:
        raise ValueError("train.global_batch_size must be set to size the datasets")
    train_iters = getattr(train_config, "train_iters", None)
    train_samples = getattr(train_config, "train_samples", None)
    if train_samples is None:
        if train_iters is None:
            raise ValueError("set train.train_iters (or train.train_samples) to size the datasets")
        train_samples = train_iters * gbs
    eval_iters = int(getattr(train_config, "eval_iters", 0) or 0)
    eval_interval = getattr(train_config, "eval_interval", None)
    iters = train_iters if train_iters is not None else -(-train_samples // gbs)
    eval_runs = (iters // eval_interval + 1) if eval_interval else 1
    return int(train_samples), eval_runs * eval_iters * gbs, eval_iters * gbs


def build_train_valid_test_datasets(
    dataset_config: GPTDatasetConfig | FinetuningDatasetConfig,
    tokenizer: Tokenizer,
    num_samples: tuple[int, int, int],
) -> tuple[Any, Any, Any]:
    """Build the train, validation and test datasets (``None`` for a split without data).

    Must be called on every rank (megatron's builder synchronises ranks with barriers).

    Args:
        dataset_config: bridge-config (or megatron) ``GPTDatasetConfig``; mock when it has
            ``mock=True`` or no blend. A ``FinetuningDatasetConfig`` gives SFT datasets
            (:func:`bridge.train.data.sft.build_sft_datasets`).
        tokenizer: The tokenizer.
        num_samples: ``(train, valid, test)`` samples to draw
            (:func:`train_valid_test_num_samples`).

    Returns:
        ``(train_ds, valid_ds, test_ds)``; with ``dataset.multiple_validation_sets``,
        ``valid_ds`` is a :class:`~bridge.train.data.validation_sets.ValidationDatasets`
        (one dataset per prefix of ``blend_per_split``'s validation entry, or per prefix of
        ``blend`` with its ``split``; each one pass over its documents with
        ``dataset.full_validation``).

    Raises:
        FileNotFoundError: A data path does not exist.
        bridge.config.ConfigError: A split would get no sample (megatron-core would loop
            forever building it; see :mod:`bridge.train.data.split_checks`).
    """

    if isinstance(dataset_config, FinetuningDatasetConfig):
        from bridge.train.data.sft import build_sft_datasets

        return build_sft_datasets(dataset_config, tokenizer, num_samples)
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    config = build_gpt_dataset_config(dataset_config, tokenizer)
    cls = MockGPTDataset if config.mock else GPTDataset
    sizes = [int(n) for n in num_samples]
    if not config.mock:
        from bridge.train.data.split_checks import check_split_samples

        check_split_samples(dataset_config, (sizes[0], sizes[1], sizes[2]))
    separate = bool(config.multiple_validation_sets) and not config.mock
    # No sample count for a full pass: megatron builds each validation set as one pass over
    # its documents (its builder asserts the count is None for full_validation).
    valid_size = None if separate and config.full_validation else sizes[1]
    built_sizes: list[int | None] = list(sizes)
    if config.blend_per_split is not None:
        built_sizes[1] = valid_size
    builder = BlendedMegatronDatasetBuilder(cls, built_sizes, lambda: True, config)
    train_ds, valid_ds, test_ds = builder.build()
    if separate and valid_ds is not None:
        valid_ds = _separate_validation_sets(
            config, valid_ds, BlendedMegatronDatasetBuilder, cls, valid_size
        )
    return train_ds, valid_ds, test_ds


def _separate_validation_sets(
    megatron_config: BlendedMegatronDatasetConfig,
    valid_ds: Any,
    builder_class: type[BlendedMegatronDatasetBuilder],
    cls: type,
    valid_size: int | None,
) -> ValidationDatasets:
    """The validation sets with their names (:mod:`bridge.train.data.validation_sets`).

    megatron-core separates ``blend_per_split``'s validation entry itself (a list, or one
    dataset for a one-prefix entry). It blends ``blend``'s validation split whatever
    ``multiple_validation_sets`` says, so each prefix's validation split is built on its
    own here: the prefix alone with the same ``split`` (the same documents as its part of
    the blend), as a one-prefix ``blend`` would give it.
    """
    full_pass = bool(megatron_config.full_validation)
    per_split = megatron_config.blend_per_split
    if per_split is not None and per_split[1] is not None:
        prefixes = per_split[1][0]
        datasets = tuple(valid_ds) if isinstance(valid_ds, list) else (valid_ds,)
        return ValidationDatasets(validation_set_names(prefixes), datasets, full_pass)
    assert megatron_config.blend is not None  # the dataset rule refused every other case
    prefixes = megatron_config.blend[0]
    built = []
    for prefix in prefixes:
        alone = dataclasses.replace(
            megatron_config, blend=([prefix], None), multiple_validation_sets=False
        )
        # Training and test splits of the prefix come with it (megatron builds every split
        # of a one-prefix blend); 0 samples keeps their indices to one epoch.
        builder = builder_class(cls, [0, valid_size, 0], lambda: True, alone)
        built.append(builder.build()[1])
    return ValidationDatasets(validation_set_names(prefixes), tuple(built), full_pass)
