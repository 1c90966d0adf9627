"""The cross-module transfer plan: every sample moves once, every send has its receive."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from hypothesis import given, settings, strategies as st

from bridge.mimo import CrossModulePlan, MimoLayout, ModulePlacement
from bridge.mimo.comm_plan import row_ranges


def _layout(enc_tp: int, enc_dp: int, lm_tp: int, lm_dp: int) -> MimoLayout:
    enc = enc_tp * enc_dp
    return MimoLayout(
        {
            "vision": ModulePlacement(ranks=range(0, enc), tp=enc_tp, dp=enc_dp),
            "language": ModulePlacement(ranks=range(enc, enc + lm_tp * lm_dp), tp=lm_tp, dp=lm_dp),
        }
    )


def test_fan_in_pairs_two_encoder_replicas_with_one_language_replica() -> None:
    plan = CrossModulePlan(_layout(1, 2, 2, 1), micro_batch_size=4)
    assert [
        (t.src_dp_rank, t.dst_dp_rank, t.sample_start, t.sample_stop) for t in plan.transfers
    ] == [
        (0, 0, 0, 2),
        (1, 0, 2, 4),
    ]
    # Each encoder rank sends to both tensor-parallel language ranks.
    assert [(t.sample_start, dst) for t, dst in plan.forward_sends(0, "vision")] == [(0, 2), (0, 3)]
    assert [t.src_leader for t in plan.forward_recvs(3, "vision")] == [0, 1]
    # Only the language leader sends gradients back.
    assert [dst for _, dst in plan.backward_sends(2, "vision")] == [0, 1]
    assert plan.backward_sends(3, "vision") == []


def test_fan_out_splits_one_encoder_replica_over_language_replicas() -> None:
    plan = CrossModulePlan(_layout(1, 1, 1, 2), micro_batch_size=4)
    assert [
        (t.src_dp_rank, t.dst_dp_rank, t.sample_start, t.sample_stop) for t in plan.transfers
    ] == [
        (0, 0, 0, 2),
        (0, 1, 2, 4),
    ]
    assert [dst for _, dst in plan.forward_sends(0, "vision")] == [1, 2]
    assert len(plan.backward_recvs(0, "vision")) == 2


def test_dp_sizes_that_are_not_multiples_still_pair_by_sample() -> None:
    plan = CrossModulePlan(_layout(1, 2, 1, 3), micro_batch_size=6)
    spans = [(t.src_dp_rank, t.dst_dp_rank, t.sample_start, t.sample_stop) for t in plan.transfers]
    assert spans == [(0, 0, 0, 2), (0, 1, 2, 3), (1, 1, 3, 4), (1, 2, 4, 6)]


def test_encoder_tensor_parallel_followers_receive_gradients_but_send_nothing() -> None:
    plan = CrossModulePlan(_layout(2, 1, 1, 2), micro_batch_size=2)
    assert plan.forward_sends(1, "vision") == []
    assert [t.dst_leader for t in plan.backward_recvs(1, "vision")] == [2, 3]
    assert sorted(dst for _, dst in plan.backward_sends(2, "vision")) == [0, 1]


def test_plan_refuses_colocated_layouts_and_indivisible_micro_batches() -> None:
    colocated = MimoLayout(
        {"vision": ModulePlacement(ranks=[0]), "language": ModulePlacement(ranks=[0])}
    )
    with pytest.raises(ValueError, match="colocated layout has no cross-module transfers"):
        CrossModulePlan(colocated, micro_batch_size=2)
    with pytest.raises(ValueError, match="micro_batch_size=3 is not divisible by module 'vision'"):
        CrossModulePlan(_layout(1, 2, 1, 1), micro_batch_size=3)


@settings(max_examples=60, deadline=None)
@given(
    enc_tp=st.integers(1, 3),
    enc_dp=st.integers(1, 4),
    lm_tp=st.integers(1, 3),
    lm_dp=st.integers(1, 4),
    per_lcm=st.integers(1, 2),
)
def test_every_send_has_exactly_one_matching_receive(
    enc_tp: int, enc_dp: int, lm_tp: int, lm_dp: int, per_lcm: int
) -> None:
    import math

    mbs = math.lcm(enc_dp, lm_dp) * per_lcm
    layout = _layout(enc_tp, enc_dp, lm_tp, lm_dp)
    plan = CrossModulePlan(layout, micro_batch_size=mbs)
    world = layout.world_size

    # Every sample of the micro-batch moves exactly once per encoder.
    covered = Counter(s for t in plan.transfers for s in range(t.sample_start, t.sample_stop))
    assert covered == Counter(range(mbs))

    for direction in ("forward", "backward"):
        sends: Counter[tuple[int, int, int]] = Counter()
        recvs: Counter[tuple[int, int, int]] = Counter()
        for rank in range(world):
            if direction == "forward":
                for t, dst in plan.forward_sends(rank, "vision"):
                    sends[(rank, dst, t.sample_start)] += 1
                for t in plan.forward_recvs(rank, "vision"):
                    recvs[(t.src_leader, rank, t.sample_start)] += 1
            else:
                for t, dst in plan.backward_sends(rank, "vision"):
                    sends[(rank, dst, t.sample_start)] += 1
                for t in plan.backward_recvs(rank, "vision"):
                    recvs[(t.dst_leader, rank, t.sample_start)] += 1
        assert sends == recvs, direction
        assert all(n == 1 for n in sends.values())

    # Each replica's transfers tile its own sample slice, in order.
    for dp in range(enc_dp):
        lo, hi = plan.sample_slice("vision", dp)
        spans = [(t.sample_start, t.sample_stop) for t in plan.peers("vision", dp, of_encoder=True)]
        assert spans[0][0] == lo and spans[-1][1] == hi
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))


def test_row_ranges_follow_per_sample_token_counts() -> None:
    plan = CrossModulePlan(_layout(1, 1, 1, 2), micro_batch_size=4)
    transfers = plan.peers("vision", 0, of_encoder=True)
    counts = torch.tensor([3, 1, 0, 2])
    assert row_ranges(transfers, 0, counts) == [(0, 4), (4, 6)]
    with pytest.raises(ValueError, match=r"outside the local samples \[2, 6\)"):
        row_ranges(transfers, 2, counts)
