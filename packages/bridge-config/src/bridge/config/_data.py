"""Data sections: the dataloader, GPT pretraining datasets and finetuning datasets."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from bridge.config._checks import at_least
from bridge.config._codec import normalize_fields
from bridge.config._errors import field_error, section_error
from bridge.config._section import config_section

#: The dataset splits megatron-core builds, in the order ``split`` and ``blend_per_split`` use.
SPLITS = ("train", "validation", "test")

_SPLIT_PATTERN = re.compile(r"^\s*\d+(\.\d*)?(\s*[,/]\s*\d+(\.\d*)?){0,2}\s*$")

Blend = tuple[list[str], list[float] | None]


def parse_split(split: str) -> list[float]:
    """Parse a split string such as ``"99,1,0"`` into normalised train/validation/test weights.

    Args:
        split: One to three non-negative numbers separated by ``,`` or ``/``; missing
            trailing weights are 0.

    Returns:
        Three weights summing to 1.

    Raises:
        ValueError: the string does not have that form or its weights sum to 0.
    """
    if not _SPLIT_PATTERN.match(split):
        raise ValueError("expected 1 to 3 non-negative numbers separated by ',' (e.g. '99,1,0')")
    weights = [float(w) for w in re.split(r"[,/]", split)]
    weights += [0.0] * (len(SPLITS) - len(weights))
    total = sum(weights)
    if total <= 0:
        raise ValueError("the split weights sum to 0; at least one split needs a positive weight")
    return [w / total for w in weights]


def _check_blend(owner: Any, name: str, blend: Blend) -> None:
    paths, weights = blend
    if not paths or any(not p for p in paths):
        raise field_error(owner, name, blend, "expected a non-empty list of dataset path prefixes")
    if weights is None:
        return
    if len(weights) != len(paths):
        raise field_error(
            owner,
            name,
            blend,
            f"{len(paths)} paths but {len(weights)} weights; give one weight per path or none",
        )
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise field_error(owner, name, blend, "weights must be non-negative with a positive sum")


@config_section
@dataclass(kw_only=True)
class DataloaderConfig:
    """Base configuration for data loading."""

    dataloader_type: Literal["single", "cyclic", "external"] | None = None
    """``"single"`` passes over the data once, ``"cyclic"`` repeats it, ``"external"`` means
    the caller supplies the iterators."""

    num_workers: int = 8
    """Number of dataloader worker processes (0: load in the main process). bridge-train
    starts at most as many as the CPUs the process may use (saying so on rank 0): workers
    change where samples are loaded, never which."""

    data_sharding: bool = True
    """Each data-parallel rank reads only its own part of every global batch. bridge-train's
    samplers always shard; it refuses false."""

    pin_memory: bool = True
    """Pin host memory of loaded batches for faster copies to the GPU (without CUDA
    bridge-train does not pin)."""

    persistent_workers: bool = False
    """Keep worker processes alive between epochs (needs ``num_workers > 0``)."""

    def __post_init__(self) -> None:
        """Check the field types and the worker settings."""
        normalize_fields(self)
        self._check_dataloader()

    def _check_dataloader(self) -> None:
        at_least(self, "num_workers", 0, allow_none=False)
        if self.persistent_workers and self.num_workers == 0:
            raise field_error(
                self,
                "persistent_workers",
                True,
                "it needs num_workers > 0; set num_workers or turn it off",
            )


@config_section
@dataclass(kw_only=True)
class GPTDatasetConfig(DataloaderConfig):
    """Configuration specific to GPT datasets, inheriting from MCore and base DataloaderConfig.

    The fields mirror megatron-core's ``GPTDatasetConfig`` (and its base
    ``BlendedMegatronDatasetConfig``) field for field, so the trainer can build megatron's
    config from this one (see ``convert_dataclass``). Intentional differences: the
    ``tokenizer`` object is not a config value (the trainer builds it from the
    ``tokenizer`` section and passes it in), megatron's derived ``split_matrix`` and
    ``token_dtype_code`` are computed by megatron, and ``mock`` may be set explicitly here.
    """

    random_seed: int
    """Seed for every random choice made while building the dataset (shuffling, sampling)."""

    sequence_length: int
    """Tokens per training sample. Must equal the model's ``seq_length``."""

    blend: Blend | None = None
    """Dataset path prefixes and optional weights, e.g. ``[["/data/a", "/data/b"], [0.3, 0.7]]``;
    without weights, datasets are weighted by size. Needs ``split``; exclusive with
    ``blend_per_split`` and ``mock``."""

    blend_per_split: list[Blend | None] | None = None
    """One blend (as for ``blend``) per split, in train/validation/test order; ``null`` for a
    split without data. Exclusive with ``blend``, ``split`` and ``mock``."""

    multiple_validation_sets: bool | None = None
    """Treat the validation split as several separate datasets, each evaluated on its own:
    every prefix of ``blend_per_split``'s validation entry (or the validation split of every
    prefix of ``blend``) is one set, not blended with the others, and its losses are logged
    as the split ``validation <name>`` (the prefix's file name, or its index when file names
    repeat), e.g. ``lm loss validation wiki``. Each set reads ``train.eval_iters`` global
    batches per evaluation. bridge-train refuses true for mock, SFT and T5 data."""

    full_validation: bool | None = None
    """Evaluate on a full pass over each validation set every time validation runs (needs
    ``multiple_validation_sets``): every sample once, from the set's first, in
    ``ceil(len(set) / train.global_batch_size)`` global batches (the last one filled up with
    samples that count for nothing) instead of ``train.eval_iters`` (which must still be > 0
    for validation to run)."""

    split: str | None = None
    """Relative weights of train/validation/test when one blend is split, e.g. ``"99,1,0"``.
    Defaults to ``"1,1,1"`` for mock data."""

    num_dataset_builder_threads: int = 1
    """Threads used to build the dataset indices."""

    path_to_cache: str | None = None
    """Directory where built dataset indices are cached and reused. With several ranks it must
    be shared by all of them."""

    mmap_bin_files: bool = True
    """Memory-map the ``.bin`` token files instead of reading them through file handles."""

    mock: bool = False
    """Use generated mock data instead of files. Set automatically when neither ``blend`` nor
    ``blend_per_split`` is given; exclusive with both."""

    mid_level_dataset_surplus: float = 0.005
    """Extra fraction of samples built for the per-source datasets of a blend, so the blended
    dataset does not run out when it oversamples a source."""

    allow_ambiguous_pad_tokens: bool | None = False
    """Keep pad tokens found in the data unmasked when the tokenizer's pad id collides with
    another special token (a workaround for a broken tokenizer; not recommended)."""

    fast_cache_load: bool = False
    """Load dataset indices through the fast path; every cache must already be built
    (needs ``path_to_cache``, not with ``blend``)."""

    defer_npy_index_mmap: bool = False
    """Memory-map the cached index files only on first access (needs ``path_to_cache``)."""

    reset_position_ids: bool | None = None
    """Restart position ids after every end-of-document token. Required (true or false)."""

    reset_attention_mask: bool | None = None
    """Stop attention across end-of-document tokens. Required (true or false)."""

    eod_mask_loss: bool | None = None
    """Exclude end-of-document tokens from the loss. Required (true or false)."""

    create_attention_mask: bool = True
    """Build an attention mask per sample; turn off when the attention kernel makes its own."""

    drop_last_partial_validation_sequence: bool = True
    """Drop the last, incomplete validation sample."""

    add_extra_token_to_sequence: bool = True
    """Draw ``sequence_length + 1`` tokens per sample so inputs and shifted labels both have
    ``sequence_length`` tokens."""

    object_storage_cache_path: str | None = None
    """Local directory caching the indices of datasets read from object storage (S3, MSC)."""

    data_parallel_size: int = 1
    """Data-parallel size, used when samples must divide evenly across data-parallel ranks."""

    sequence_parallel_size: int = 0
    """Sequence-parallel size when sequence parallelism is on with tensor parallelism
    (0: off)."""

    hybrid_context_parallel: bool = False
    """Hybrid context parallelism: every sample must divide by data-parallel size times
    context-parallel size times 2 (times the sequence-parallel size when that is on)."""

    sequences_per_dataset: dict[str, int] | None = None
    """Precomputed sequence and document counts per dataset path, to skip reading them from
    the index files."""

    context_parallel_size: int | None = None
    """Context-parallel size, used to pad packed sequences."""

    inter_document_masking: bool = False
    """Return ``cu_seqlens`` marking document boundaries so attention stays within documents."""

    def __post_init__(self) -> None:
        """Check the field types, the data source (blend, blend_per_split or mock) and split.

        Without ``blend`` and ``blend_per_split`` the dataset is mock data (``mock`` becomes
        true and ``split`` defaults to ``"1,1,1"``), as in megatron-core.
        """
        normalize_fields(self)
        self._check_dataloader()
        self._check_source()
        at_least(self, "sequence_length", 1, allow_none=False)
        if not 0 <= self.random_seed <= 2**32 - 1:
            raise field_error(
                self, "random_seed", self.random_seed, "expected a value in [0, 4294967295]"
            )
        at_least(self, "num_dataset_builder_threads", 1, allow_none=False)
        at_least(self, "mid_level_dataset_surplus", 0, allow_none=False)
        at_least(self, "data_parallel_size", 1, allow_none=False)
        at_least(self, "sequence_parallel_size", 0, allow_none=False)
        at_least(self, "context_parallel_size", 1)
        for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
            if getattr(self, name) is None:
                raise field_error(self, name, None, "it is required; set it to true or false")
        if self.fast_cache_load:
            if self.path_to_cache is None:
                raise field_error(self, "fast_cache_load", True, "it needs path_to_cache to be set")
            if self.blend is not None:
                raise section_error(
                    self, "fast_cache_load cannot be used with blend; use blend_per_split instead"
                )
        if self.defer_npy_index_mmap and self.path_to_cache is None:
            raise field_error(
                self, "defer_npy_index_mmap", True, "it needs path_to_cache to be set"
            )

    def _check_source(self) -> None:
        if self.blend is not None and self.blend_per_split is not None:
            raise section_error(
                self, "blend and blend_per_split are mutually exclusive; set only one"
            )
        if self.mock and (self.blend is not None or self.blend_per_split is not None):
            chosen = "blend" if self.blend is not None else "blend_per_split"
            raise section_error(
                self,
                f"mock and {chosen} are mutually exclusive; mock data reads no files (set mock to false to read the {chosen})",
            )
        if self.blend_per_split is not None:
            if len(self.blend_per_split) != len(SPLITS):
                raise field_error(
                    self,
                    "blend_per_split",
                    self.blend_per_split,
                    f"expected {len(SPLITS)} entries ({', '.join(SPLITS)}); use null for a split without data",
                )
            if all(b is None for b in self.blend_per_split):
                raise field_error(
                    self,
                    "blend_per_split",
                    self.blend_per_split,
                    "give a blend for at least one split",
                )
            if self.split is not None:
                raise section_error(
                    self,
                    "split and blend_per_split are mutually exclusive; blend_per_split already assigns data to splits",
                )
            for name, blend in zip(SPLITS, self.blend_per_split, strict=True):
                if blend is not None:
                    _check_blend(self, f"blend_per_split[{name}]", blend)
            return
        if self.blend is not None:
            _check_blend(self, "blend", self.blend)
            if self.split is None:
                raise field_error(self, "split", None, "it is required with blend, e.g. '99,1,0'")
        else:
            self.mock = True
            if self.split is None:
                self.split = "1,1,1"
        assert self.split is not None
        try:
            parse_split(self.split)
        except ValueError as exc:
            raise field_error(self, "split", self.split, str(exc)) from None


@config_section
@dataclass(kw_only=True)
class MockGPTDatasetConfig(GPTDatasetConfig):
    """Modifies GPTDatasetConfig to enforce necessary options for creating a mock dataset."""

    blend: None = field(init=False, repr=False, default=None)
    """Always ``None``: mock data reads no files (not settable)."""

    blend_per_split: None = field(init=False, repr=False, default=None)
    """Always ``None``: mock data reads no files (not settable)."""

    mock: bool = True
    """Always true: this dataset generates its samples (setting it false is an error)."""

    def __post_init__(self) -> None:
        """Check that no blend is set and ``mock`` is true, then run the GPT dataset checks."""
        for name in ("blend", "blend_per_split"):
            if getattr(self, name) is not None:
                raise field_error(
                    self,
                    name,
                    getattr(self, name),
                    "mock data reads no files; use GPTDatasetConfig for real data",
                )
        if self.mock is not True:
            raise field_error(
                self,
                "mock",
                self.mock,
                "MockGPTDatasetConfig always uses mock data; use GPTDatasetConfig for real data",
            )
        super().__post_init__()


@config_section
@dataclass(kw_only=True)
class PackedSequenceSpecs:
    """Where packed finetuning data lives and how long a packed sequence is."""

    packed_sequence_size: int = -1
    """Tokens per packed sequence; -1 (or 0) turns packing off."""

    tokenizer_model_name: str | None = None
    """Name of the tokenizer the packed files were built with, to detect mismatches."""

    packed_train_data_path: str | None = None
    """Packed training data file (``.npy``)."""

    packed_val_data_path: str | None = None
    """Packed validation data file (``.npy``)."""

    packed_metadata_path: str | None = None
    """Metadata file written when the data was packed."""

    pad_cu_seqlens: bool = False
    """Pad ``cu_seqlens`` to a constant length (needed for CUDA graphs)."""

    def __post_init__(self) -> None:
        """Check the field types and the packed sequence size."""
        normalize_fields(self)
        at_least(self, "packed_sequence_size", -1, allow_none=False)


@config_section
@dataclass(kw_only=True)
class FinetuningDatasetConfig(DataloaderConfig):
    """Configuration specific to finetuning datasets, inheriting from DataloaderConfig."""

    dataset_root: str | Path | None = None
    """Directory holding the finetuning data files (stored as a ``Path``)."""

    seq_length: int | None = None
    """Tokens per sample. Must equal the model's ``seq_length``; required by
    ``ConfigContainer.validate()`` (unset, as the reference's default, only while the
    config is being assembled)."""

    seed: int = 1234
    """Seed for shuffling and sampling the finetuning data."""

    memmap_workers: int = 1
    """Worker processes used to memory-map and index the data files."""

    max_train_samples: int | None = None
    """Use at most this many training samples (all when unset)."""

    packed_sequence_specs: PackedSequenceSpecs | None = None
    """Packed-sequence settings; unset trains on unpacked samples."""

    dataset_kwargs: dict[str, Any] | None = None
    """Extra keyword arguments passed to the finetuning dataset class."""

    do_validation: bool = True
    """Build a validation dataset."""

    do_test: bool = True
    """Build a test dataset."""

    def __post_init__(self) -> None:
        """Check the field types and ranges; store ``dataset_root`` as a ``Path``."""
        normalize_fields(self)
        self._check_dataloader()
        if isinstance(self.dataset_root, str):
            self.dataset_root = Path(self.dataset_root)
        at_least(self, "seq_length", 1)
        if not 0 <= self.seed <= 2**32 - 1:
            raise field_error(self, "seed", self.seed, "expected a value in [0, 4294967295]")
        at_least(self, "memmap_workers", 1, allow_none=False)
        at_least(self, "max_train_samples", 1)
