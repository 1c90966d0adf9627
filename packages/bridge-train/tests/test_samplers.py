"""Samplers: one global order whatever the data-parallel size, exact resume."""

from __future__ import annotations

import itertools

import pytest

from bridge.train.data import CyclicRandomSampler, PretrainingSampler


def _global_batches(sampler_cls, dp: int, mbs: int, gbs: int, steps: int, consumed: int = 0, **kw):
    """The set of samples of each global batch, gathered over all dp ranks."""
    micro_per_rank = gbs // (mbs * dp)
    iters = [iter(sampler_cls(100, consumed, mbs, rank, dp, **kw)) for rank in range(dp)]
    batches = []
    for _ in range(steps):
        batch: list[int] = []
        for it in iters:
            for _ in range(micro_per_rank):
                batch += next(it)
        batches.append(sorted(batch))
    return batches


@pytest.mark.parametrize("sampler_cls", [PretrainingSampler, CyclicRandomSampler])
def test_global_batches_do_not_depend_on_data_parallel_or_micro_batch_size(sampler_cls) -> None:
    reference = _global_batches(sampler_cls, dp=1, mbs=8, gbs=8, steps=10)
    for dp, mbs in [(1, 2), (2, 4), (2, 1), (4, 2), (8, 1)]:
        assert _global_batches(sampler_cls, dp=dp, mbs=mbs, gbs=8, steps=10) == reference, (dp, mbs)


@pytest.mark.parametrize("sampler_cls", [PretrainingSampler, CyclicRandomSampler])
def test_resume_from_consumed_samples_continues_the_stream(sampler_cls) -> None:
    full = _global_batches(sampler_cls, dp=2, mbs=2, gbs=8, steps=10)
    resumed = _global_batches(sampler_cls, dp=2, mbs=2, gbs=8, steps=6, consumed=4 * 8)
    assert resumed == full[4:]


def test_pretraining_sampler_splits_chunks_between_ranks_and_drops_the_tail() -> None:
    rank0 = list(PretrainingSampler(10, 0, 2, 0, 2))
    rank1 = list(PretrainingSampler(10, 0, 2, 1, 2))
    assert rank0 == [[0, 1], [4, 5]] and rank1 == [[2, 3], [6, 7]]
    assert len(PretrainingSampler(10, 0, 2, 0, 2)) == 2
    assert list(PretrainingSampler(10, 8, 2, 0, 2, drop_last=False)) == [[8, 9]]
    assert list(PretrainingSampler(10, 8, 2, 1, 2, drop_last=False)) == []


def test_cyclic_sampler_repeats_epochs_with_new_permutations() -> None:
    stream = list(itertools.islice(iter(CyclicRandomSampler(6, 0, 3, 0, 1, seed=5)), 4))
    first, second = stream[0] + stream[1], stream[2] + stream[3]
    assert sorted(first) == sorted(second) == list(range(6))
    assert first != second
    assert list(itertools.islice(iter(CyclicRandomSampler(6, 0, 3, 0, 1, seed=5)), 4)) == stream


def test_bad_sampler_arguments_are_named() -> None:
    with pytest.raises(ValueError, match=r"data_parallel_rank=2"):
        PretrainingSampler(10, 0, 2, 2, 2)
    with pytest.raises(ValueError, match=r"micro_batch_size"):
        CyclicRandomSampler(10, 0, 0, 0, 1)
    with pytest.raises(ValueError, match=r"no samples"):
        PretrainingSampler(0, 0, 1, 0, 1)
