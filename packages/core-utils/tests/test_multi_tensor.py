"""The amp_C stand-ins against plain torch."""

from __future__ import annotations

import pytest
import torch

import core_utils


def _tensors() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2, 2).to(torch.bfloat16)]


def test_l2_norm_matches_torch() -> None:
    tensors = _tensors()
    noop = torch.zeros(1, dtype=torch.int32)
    total, per = core_utils.local_multi_tensor_applier(
        core_utils.local_multi_tensor_l2_norm, noop, [tensors], True
    )
    expected_per = torch.stack([t.float().norm() for t in tensors])
    assert total.shape == (1,) and total.dtype == torch.float32
    torch.testing.assert_close(per, expected_per)
    torch.testing.assert_close(
        total, torch.cat([t.float().flatten() for t in tensors]).norm().reshape(1)
    )
    total_only, none_per = core_utils.local_multi_tensor_l2_norm(2048, noop, [tensors], False)
    torch.testing.assert_close(total_only, total)
    assert none_per.shape == (0,)
    assert noop.item() == 0
    empty_total, _ = core_utils.local_multi_tensor_l2_norm(2048, noop, [[]], True)
    assert empty_total.item() == 0.0


def test_scale_matches_torch_and_flags_overflow() -> None:
    sources = _tensors()
    destinations = [torch.empty_like(t, dtype=torch.float32) for t in sources]
    noop = torch.zeros(1, dtype=torch.int32)
    result = core_utils.local_multi_tensor_applier(
        core_utils.local_multi_tensor_scale, noop, [sources, destinations], 0.5
    )
    assert result is None
    for src, dst in zip(sources, destinations, strict=True):
        torch.testing.assert_close(dst, src.float() * 0.5)
    assert noop.item() == 0
    bad = [torch.tensor([1.0, float("inf")])]
    out = [torch.empty(2)]
    core_utils.local_multi_tensor_scale(2048, noop, [bad, out], 2.0)
    assert noop.item() == 1
    assert out[0][0].item() == 2.0  # still written


def test_scale_rejects_mismatched_lists() -> None:
    noop = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"\[sources, destinations\], got 1 lists"):
        core_utils.local_multi_tensor_scale(1, noop, [[torch.ones(1)]], 1.0)
    with pytest.raises(ValueError, match="2 sources but 1 destinations"):
        core_utils.local_multi_tensor_scale(1, noop, [[torch.ones(1)] * 2, [torch.ones(1)]], 1.0)
    with pytest.raises(
        ValueError, match=r"pair 0 has source shape \(2,\) and destination shape \(3,\)"
    ):
        core_utils.local_multi_tensor_scale(1, noop, [[torch.ones(2)], [torch.ones(3)]], 1.0)
