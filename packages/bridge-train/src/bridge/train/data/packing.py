"""Packed SFT sequences: several examples in one sequence, attention kept per example.

With ``dataset.packed_sequence_specs.packed_sequence_size`` > 0, the examples of a split
are packed into sequences of that many tokens. Each epoch the (seeded) example order is
packed greedily first-fit into bins, so short examples share a sequence instead of being
padded one by one. In every packed sample:

* ``position_ids`` restart at 0 for each example;
* ``attention_mask`` (``[1, s, s]``, ``True`` = masked) is block-diagonal causal: a token
  attends to earlier tokens of its own example only (torch SDPA core attention, any
  device);
* ``cu_seqlens`` holds the example boundaries (padded with the total length to
  ``s + 1`` entries so samples collate);
* ``loss_mask`` is that of each example (answer tokens only).

So each example's per-token losses are those it would get alone, and changing one example
leaves the others' logits unchanged. Packing happens in memory from ``dataset_root``:
pre-packed files (``packed_train_data_path`` and friends) are refused by
:func:`check_packed_sequence_specs`, and so is a model whose attention would not read the
block-diagonal mask (any ``model.layer_spec_backend`` but the portable SDPA one: Transformer
Engine needs megatron-core's ``PackedSeqParams``, which this trainer does not build yet).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from bridge.train.data.sft import TokenizedExamples, build_sample, fit_examples

__all__ = [
    "PackedSFTDataset",
    "check_packed_sequence_specs",
    "first_fit_bins",
]


def check_packed_sequence_specs(specs: Any, seq_length: int | None, model: Any = None) -> None:
    """Refuse packed-sequence settings this trainer cannot honour.

    Args:
        specs: ``dataset.packed_sequence_specs`` (``None`` or size <= 0: no packing).
        seq_length: ``dataset.seq_length``.
        model: The model provider; its ``resolved_layer_spec_backend()`` must be
            ``"portable"`` (SDPA attention reads the block-diagonal mask).

    Raises:
        bridge.config.ConfigError: Pre-packed file paths or a tokenizer name for them are
            set (packing is done in memory), the packed size differs from
            ``dataset.seq_length``, or the model's attention cannot confine itself to each
            example.
    """
    from bridge.config import ConfigError

    if specs is None or specs.packed_sequence_size <= 0:
        return
    resolve = getattr(model, "resolved_layer_spec_backend", None)
    try:
        backend = resolve() if resolve is not None else None
    except ValueError as exc:
        raise ConfigError("model.layer_spec_backend", str(exc)) from None
    if model is not None and backend != "portable":
        raise ConfigError(
            "model.layer_spec_backend",
            f"packed sequences need the portable (SDPA) attention, which reads their "
            f"block-diagonal mask; this model resolves to {backend!r}: set "
            "model.layer_spec_backend=portable or unset dataset.packed_sequence_specs",
        )
    for name in (
        "packed_train_data_path",
        "packed_val_data_path",
        "packed_metadata_path",
        "tokenizer_model_name",
    ):
        if getattr(specs, name) is not None:
            raise ConfigError(
                f"dataset.packed_sequence_specs.{name}",
                "pre-packed files are not read: examples are packed in memory from "
                "dataset.dataset_root (tokenized cache included); unset this field",
            )
    if seq_length is not None and specs.packed_sequence_size != seq_length:
        raise ConfigError(
            "dataset.packed_sequence_specs.packed_sequence_size",
            f"got {specs.packed_sequence_size} but dataset.seq_length is {seq_length}; a "
            "packed sequence is one model sample, so set them equal",
        )


def first_fit_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """Pack items (in the given order) into bins of ``capacity`` by first fit.

    Args:
        lengths: Size of each item (each at most ``capacity``).
        capacity: Bin size.

    Returns:
        Bins as lists of item indices, in order of creation.
    """
    bins: list[list[int]] = []
    free: list[int] = []
    for index, length in enumerate(lengths):
        for number, room in enumerate(free):
            if length <= room:
                bins[number].append(index)
                free[number] -= length
                break
        else:
            bins.append([index])
            free.append(capacity - length)
    return bins


class PackedSFTDataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Map-style dataset of packed SFT samples (see the module docstring).

    Args:
        examples: Tokenized records.
        seq_length: Tokens per packed sequence.
        pad_token: Id used for padding.
        truncation: ``"left"``, ``"right"`` or ``"drop"`` for an example longer than one
            sequence.
        num_samples: Packed samples the run needs (whole epochs, at least one).
        shuffle_seed: Shuffle examples each epoch with ``seed + epoch`` before packing;
            ``None`` packs in file order.
        name: Split name for log lines.

    Raises:
        ValueError: No example fits.
    """

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
        kept, self.skipped = fit_examples(
            examples, self.seq_length, truncation, f"packed SFT {name} split"
        )
        self.examples = kept
        # An example of n ids fills n - 1 positions.
        sizes = [len(ids) - 1 for ids, _ in kept]
        self.bins: list[list[int]] = []
        epoch = 0
        while True:
            if shuffle_seed is None:
                order = np.arange(len(kept))
            else:
                order = np.random.default_rng(int(shuffle_seed) + epoch).permutation(len(kept))
            bins = first_fit_bins([sizes[i] for i in order], self.seq_length)
            self.bins += [[int(order[i]) for i in b] for b in bins]
            epoch += 1
            if len(self.bins) >= num_samples:
                break
        self.epochs = epoch

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        parts = [self.examples[i] for i in self.bins[index]]
        return build_sample(parts, self.seq_length, self.pad_token, packed=True)

    def useful_tokens(self) -> int:
        """Positions of all packed samples that hold an example (not padding)."""
        return sum(len(self.examples[i][0]) - 1 for b in self.bins for i in b)
