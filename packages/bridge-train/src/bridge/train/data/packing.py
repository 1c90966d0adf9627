"""Packed SFT sequences: several examples in one sequence, attention kept per example.

With ``dataset.packed_sequence_specs.packed_sequence_size`` > 0, the examples of a split
are packed into sequences of that many tokens. Each epoch the (seeded) example order is
packed greedily first-fit into bins, so short examples share a sequence instead of being
padded one by one. In every packed sample:

* ``position_ids`` restart at 0 for each example;
* ``attention_mask`` (``[1, s, s]``, ``True`` = masked) is block-diagonal causal: a token
  attends to earlier tokens of its own example only (what the portable layer spec's torch
  SDPA core attention reads, on any device);
* ``cu_seqlens`` holds the example boundaries (padded with the total length to ``s + 1``
  entries so samples collate), ``cu_seqlens_count`` how many of its entries megatron's
  ``PackedSeqParams`` get and ``max_seqlen`` the longest example (both per
  ``packed_sequence_specs.pad_cu_seqlens``; see :class:`PackedSFTDataset`);
* ``loss_mask`` is that of each example (answer tokens only).

So each example's per-token losses are those it would get alone, and changing one example
leaves the others' logits unchanged. With the Transformer Engine layer spec (GPU),
:func:`packed_seq_params` turns a packed micro-batch into megatron-core's
``PackedSeqParams`` (``thd`` format), which the forward step hands to the model instead of
the mask. Packing happens in memory from ``dataset_root``: pre-packed files
(``packed_train_data_path`` and friends) are refused by :func:`check_packed_sequence_specs`,
and so is a model whose attention reads neither the mask nor ``PackedSeqParams``
(megatron's ``local`` spec).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from bridge.config import ConfigError, ModelConfigProtocol
from bridge.train.data.sft import SFTDataset, build_sample, epoch_order
from bridge.train.models.mamba_provider import MambaProvider

__all__ = [
    "PACKED_BATCH_KEYS",
    "PackedSFTDataset",
    "check_packed_sequence_specs",
    "first_fit_bins",
    "packed_seq_params",
]

PACKED_BATCH_KEYS = ("cu_seqlens", "cu_seqlens_count", "max_seqlen")
"""Keys a packed sample holds besides those of a GPT sample."""

_PACKED_BACKENDS = ("portable", "transformer_engine")


def check_packed_sequence_specs(
    specs: Any, seq_length: int | None, model: ModelConfigProtocol | None = None
) -> None:
    """Refuse packed-sequence settings this trainer cannot honour.

    Args:
        specs: ``dataset.packed_sequence_specs`` (``None`` or size <= 0: no packing).
        seq_length: ``dataset.seq_length``.
        model: The model provider; its ``resolved_layer_spec_backend()`` must be
            ``"portable"`` (SDPA attention reads the block-diagonal mask) or
            ``"transformer_engine"`` (reads ``PackedSeqParams``).

    Raises:
        bridge.config.ConfigError: Pre-packed file paths or a tokenizer name for them are
            set (packing is done in memory), the packed size differs from
            ``dataset.seq_length``, the model's attention cannot confine itself to each
            example (also any hybrid Mamba model), ``pad_cu_seqlens`` is set for the
            portable spec (which does not read
            ``cu_seqlens``), or Transformer Engine packing is asked for with context
            parallelism.
    """

    if specs is None or specs.packed_sequence_size <= 0:
        return

    if isinstance(model, MambaProvider):
        raise ConfigError(
            "dataset.packed_sequence_specs.packed_sequence_size",
            "packed sequences are not supported for hybrid Mamba models: the per-example "
            "mask confines attention layers only, and the Mamba layers' state would run "
            "from one example into the next; unset dataset.packed_sequence_specs",
        )
    resolve = getattr(model, "resolved_layer_spec_backend", None)
    try:
        backend = resolve() if resolve is not None else None
    except ValueError as exc:
        raise ConfigError("model.layer_spec_backend", str(exc)) from None
    if model is not None and backend not in _PACKED_BACKENDS:
        raise ConfigError(
            "model.layer_spec_backend",
            f"packed sequences need attention that confines itself to each example: the "
            f"portable (SDPA) spec reads their block-diagonal mask, Transformer Engine reads "
            f"megatron's PackedSeqParams; this model resolves to {backend!r}: set "
            "model.layer_spec_backend=portable, or install Transformer Engine "
            "(pip install bridge-train[te]) and set it to transformer_engine, or unset "
            "dataset.packed_sequence_specs",
        )
    if backend == "portable" and specs.pad_cu_seqlens:
        raise ConfigError(
            "dataset.packed_sequence_specs.pad_cu_seqlens",
            "pads the cu_seqlens of Transformer Engine's PackedSeqParams to one shape (for "
            "CUDA graphs); the portable (SDPA) spec reads the block-diagonal mask instead, so "
            "it would do nothing: unset it, or use model.layer_spec_backend=transformer_engine",
        )
    if backend == "transformer_engine" and int(getattr(model, "context_parallel_size", 1)) > 1:
        raise ConfigError(
            "model.context_parallel_size",
            "packed sequences are not split across context-parallel ranks (the thd layout "
            "needs Transformer Engine's partitioned indices, not built here); set "
            "model.context_parallel_size=1 or unset dataset.packed_sequence_specs",
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


class PackedSFTDataset(SFTDataset):
    """Map-style dataset of packed SFT samples (see the module docstring).

    Args:
        examples, seq_length, pad_token, truncation, num_samples, shuffle_seed, name: As
            for :class:`~bridge.train.data.sft.SFTDataset`; ``seq_length`` is the tokens of
            a packed sequence, ``num_samples`` counts packed samples, and the examples are
            shuffled each epoch before packing.
        pad_cu_seqlens: ``packed_sequence_specs.pad_cu_seqlens``. False: a sample's
            ``cu_seqlens_count`` is its number of examples + 1 and ``max_seqlen`` its
            longest example (the last one counted with the trailing padding). True: every
            sample gives ``PackedSeqParams`` of one shape (``s + 1`` boundaries, the extra
            ones empty sequences at the end; ``max_seqlen = s``), as CUDA graphs need.

    Raises:
        ValueError: No example fits.
    """

    _label = "packed SFT"

    def __init__(self, *args: Any, pad_cu_seqlens: bool = False, **kwargs: Any) -> None:
        self.pad_cu_seqlens = bool(pad_cu_seqlens)
        super().__init__(*args, **kwargs)

    def _arrange(self, num_samples: int, shuffle_seed: int | None) -> None:
        # An example of n ids fills n - 1 positions.
        sizes = [len(ids) - 1 for ids, _ in self.examples]
        self.bins: list[list[int]] = []
        for epoch in itertools.count():
            order = epoch_order(len(self.examples), shuffle_seed, epoch)
            bins = first_fit_bins([sizes[i] for i in order], self.seq_length)
            self.bins += [[int(order[i]) for i in b] for b in bins]
            if len(self.bins) >= num_samples:
                break

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        parts = [self.examples[i] for i in self.bins[index]]
        sample = build_sample(parts, self.seq_length, self.pad_token, packed=True)
        if self.pad_cu_seqlens:
            count, longest = self.seq_length + 1, self.seq_length
        else:
            bounds = sample["cu_seqlens"][: len(parts) + 1].tolist()
            bounds[-1] = self.seq_length  # the last example takes the trailing padding
            count = len(parts) + 1
            longest = max(b - a for a, b in itertools.pairwise(bounds))
        sample["cu_seqlens_count"] = torch.tensor(count, dtype=torch.int64)
        sample["max_seqlen"] = torch.tensor(longest, dtype=torch.int64)
        return sample

    def useful_tokens(self) -> int:
        """Positions of all packed samples that hold an example (not padding)."""
        return sum(len(self.examples[i][0]) - 1 for b in self.bins for i in b)


def packed_seq_params(batch: dict[str, Any]) -> Any:
    """megatron-core ``PackedSeqParams`` (``thd`` format) of a packed micro-batch of one sample.

    ``cu_seqlens_q`` / ``cu_seqlens_kv`` hold the example boundaries (the first
    ``cu_seqlens_count`` entries of the sample's ``cu_seqlens``); the padded variants are
    the same boundaries with the trailing padding given to the last example, so they end
    at the sequence length (with ``pad_cu_seqlens`` the extra entries are empty sequences
    there); ``max_seqlen_q`` / ``max_seqlen_kv`` come from the sample.

    Args:
        batch: A collated packed batch (``tokens`` ``[1, s]``, ``cu_seqlens`` ``[1, s + 1]``,
            ``cu_seqlens_count`` and ``max_seqlen`` ``[1]``).

    Returns:
        ``megatron.core.packed_seq_params.PackedSeqParams``.

    Raises:
        ValueError: The micro-batch holds more than one sample (the ``thd`` layout packs
            examples into one sequence; use ``train.micro_batch_size=1``) or lacks a key.
    """

    missing = [key for key in ("tokens", *PACKED_BATCH_KEYS) if batch.get(key) is None]
    if missing:
        raise ValueError(f"packed_seq_params: the batch has no {missing}; is it packed?")
    tokens = batch["tokens"]
    if tokens.dim() != 2 or tokens.shape[0] != 1:
        raise ValueError(
            f"packed_seq_params: got a micro-batch of shape {tuple(tokens.shape)}; packed "
            "sequences with Transformer Engine need train.micro_batch_size=1"
        )
    seq_length = int(tokens.shape[1])
    count = int(batch["cu_seqlens_count"].reshape(-1)[0])
    cu_seqlens = batch["cu_seqlens"].reshape(-1)[:count].to(torch.int32)
    total = cu_seqlens[-1]
    padded = torch.where(cu_seqlens == total, torch.full_like(cu_seqlens, seq_length), cu_seqlens)
    longest = int(batch["max_seqlen"].reshape(-1)[0])
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
