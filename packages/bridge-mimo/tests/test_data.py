"""Data loading: deterministic, seedable, resumable, and sliced by each module's DP rank."""

from __future__ import annotations

import math

import pytest
import torch

from bridge.mimo import MimoDataLoader, SyntheticImageCaptionDataset


class _Indices:
    """A dataset whose samples are their own index (to check which samples a rank gets)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"index": torch.tensor(index)}


def _loader(dp_rank: int = 0, dp_size: int = 1, **kwargs) -> MimoDataLoader:
    args = {"global_batch_size": 8, "micro_batch_size": 4, "seed": 3} | kwargs
    return MimoDataLoader(_Indices(20), dp_rank=dp_rank, dp_size=dp_size, **args)


def test_replicas_of_any_dp_size_split_each_micro_batch_in_order() -> None:
    full = _loader().step_indices()
    for dp_size in (1, 2, 4):
        slices = [next(_loader(r, dp_size)) for r in range(dp_size)]
        for k in range(2):
            joined = torch.cat([s[k]["index"] for s in slices]).tolist()
            assert joined == full[k]


def test_order_is_seeded_and_covers_an_epoch_without_repeats() -> None:
    a = _loader(seed=3)
    b = _loader(seed=3)
    c = _loader(seed=4)
    steps_a = [a.step_indices(s * 8) for s in range(2)]
    assert steps_a == [b.step_indices(s * 8) for s in range(2)]
    assert steps_a != [c.step_indices(s * 8) for s in range(2)]
    # 20 samples, global batch 8: an epoch is 2 whole batches of distinct samples.
    epoch = [i for step in steps_a for mb in step for i in mb]
    assert len(set(epoch)) == 16
    unshuffled = _loader(shuffle=False).step_indices()
    assert unshuffled == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_resuming_from_a_sample_count_continues_the_same_order() -> None:
    straight = _loader(1, 2)
    seen = [[mb["index"].tolist() for mb in next(straight)] for _ in range(5)]
    resumed = _loader(1, 2, consumed_samples=24)
    assert [[mb["index"].tolist() for mb in next(resumed)] for _ in range(2)] == seen[3:]
    state = straight.state_dict()
    assert state == {"consumed_samples": 40, "seed": 3}
    fresh = _loader(1, 2)
    fresh.load_state_dict(state)
    assert fresh.consumed_samples == 40
    with pytest.raises(ValueError, match="saved with seed=9 but this loader has seed=3"):
        fresh.load_state_dict({"consumed_samples": 8, "seed": 9})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"global_batch_size": 8, "micro_batch_size": 3},
            "global_batch_size=8 is not a multiple of micro_batch_size=3",
        ),
        (
            {"micro_batch_size": 4, "dp_size": 3},
            "micro_batch_size=4 is not divisible by the data-parallel size 3",
        ),
        ({"dp_rank": 2, "dp_size": 2}, r"dp_rank must be in \[0, 2\), got 2"),
        (
            {"consumed_samples": 4},
            "consumed_samples=4 must be a non-negative multiple of global_batch_size=8",
        ),
        (
            {"global_batch_size": 24, "micro_batch_size": 4},
            "the dataset has 20 samples, fewer than global_batch_size=24",
        ),
    ],
)
def test_bad_loader_arguments_name_the_value(kwargs: dict, message: str) -> None:
    args = {"global_batch_size": 8, "micro_batch_size": 4, "dp_rank": 0, "dp_size": 1} | kwargs
    with pytest.raises(ValueError, match=message):
        MimoDataLoader(_Indices(20), **args)


def test_synthetic_captions_name_the_image_class() -> None:
    ds = SyntheticImageCaptionDataset(32, image_tokens=16, seq_length=24, num_classes=4, seed=1)
    assert ds.vocab_size == 15
    sample = ds[5]
    label = ds.class_of(5)
    assert int(sample["class_label"]) == label
    ids = sample["input_ids"]
    assert ids.shape == (24,) and (ids[:16] == ds.image_token_id).all()
    masked_labels = sample["labels"][sample["loss_mask"].bool()].tolist()
    assert masked_labels == [4, 5, 6, *ds.name_tokens(label), 2]
    # Same index, same sample; images of one class are closer to their template.
    assert torch.equal(
        ds[5]["modality_inputs"]["vision"]["patch_encoder"]["images"],
        sample["modality_inputs"]["vision"]["patch_encoder"]["images"],
    )
    image = sample["modality_inputs"]["vision"]["patch_encoder"]["images"]
    distances = [(image - t).norm() for t in ds.templates]
    assert int(torch.stack(distances).argmin()) == label
    assert ds.text_only_loss_floor() == pytest.approx(math.log(4) / 6)
    with pytest.raises(ValueError, match="seq_length=10 is too short for 16 image tokens"):
        SyntheticImageCaptionDataset(4, image_tokens=16, seq_length=10)
    with pytest.raises(IndexError):
        ds[32]
