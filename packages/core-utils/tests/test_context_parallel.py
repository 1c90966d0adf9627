"""Load-balanced context-parallel slicing against hand-computed expectations."""

from __future__ import annotations

import pytest
import torch

import core_utils


def _batch(seq: int = 8) -> dict[str, object]:
    return {
        "tokens": torch.arange(2 * seq).reshape(2, seq),
        "labels": torch.arange(2 * seq).reshape(2, seq) + 100,
        "position_ids": torch.arange(seq).repeat(2, 1),
        "attention_mask": torch.arange(seq * seq).reshape(1, 1, seq, seq),
        "loss_mask": None,
        "num_tokens": 16,
        "scalar": torch.tensor(3),
    }


def test_cp2_slicing_by_hand() -> None:
    # seq 8, cp 2 -> 4 chunks of 2: rank 0 keeps chunks 0 and 3, rank 1 keeps 1 and 2.
    batch = _batch()
    rank0 = core_utils.get_batch_on_this_cp_rank(batch, cp_size=2, cp_rank=0)
    rank1 = core_utils.get_batch_on_this_cp_rank(batch, cp_size=2, cp_rank=1)
    assert rank0["tokens"].tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    assert rank1["tokens"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert rank0["position_ids"].tolist() == [[0, 1, 6, 7]] * 2
    assert rank1["labels"].tolist() == [[102, 103, 104, 105], [110, 111, 112, 113]]
    # attention_mask: query rows (dim 2) are split, key columns (dim 3) kept whole.
    mask0 = rank0["attention_mask"]
    assert mask0.shape == (1, 1, 4, 8)
    full = batch["attention_mask"]
    assert torch.equal(mask0[0, 0], full[0, 0, [0, 1, 6, 7]])  # type: ignore[index]
    # Non-tensors, None and tensors without a sequence dimension pass through.
    assert rank0["loss_mask"] is None and rank0["num_tokens"] == 16
    assert rank0["scalar"] is batch["scalar"]
    # The input batch is not modified.
    assert batch["tokens"].shape == (2, 8)  # type: ignore[attr-defined]


def test_cp4_reassembles_the_sequence() -> None:
    seq, cp = 16, 4
    tokens = torch.arange(seq).unsqueeze(0)
    parts = [
        core_utils.get_batch_on_this_cp_rank({"tokens": tokens}, cp_size=cp, cp_rank=r)["tokens"]
        for r in range(cp)
    ]
    chunk = seq // (2 * cp)
    for r, part in enumerate(parts):
        expected = list(range(r * chunk, (r + 1) * chunk)) + list(
            range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk)
        )
        assert part[0].tolist() == expected
    assert sorted(torch.cat(parts, dim=1)[0].tolist()) == list(range(seq))


def test_no_context_parallelism_returns_the_batch() -> None:
    batch = _batch()
    out = core_utils.get_batch_on_this_cp_rank(batch)
    assert out == batch and out is not batch
    assert (
        core_utils.get_batch_on_this_cp_rank(batch, cp_size=1, cp_rank=0)["tokens"]
        is batch["tokens"]
    )


def test_bad_layouts_are_rejected() -> None:
    with pytest.raises(
        ValueError, match=r"batch\['tokens'\] has sequence length 6.*2 \* cp_size = 4"
    ):
        core_utils.get_batch_on_this_cp_rank({"tokens": torch.zeros(1, 6)}, cp_size=2, cp_rank=0)
    with pytest.raises(ValueError, match="give cp_size and cp_rank together"):
        core_utils.get_batch_on_this_cp_rank({}, cp_size=2)
    with pytest.raises(ValueError, match=r"cp_rank must be in \[0, 2\), got 2"):
        core_utils.get_batch_on_this_cp_rank({}, cp_size=2, cp_rank=2)
    with pytest.raises(ValueError, match="cp_size must be >= 1"):
        core_utils.get_batch_on_this_cp_rank({}, cp_size=0, cp_rank=0)
