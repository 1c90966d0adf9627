"""Heterogeneous layouts train exactly like one process on the whole global batch.

For each layout, 5 optimizer steps (SGD with momentum, global-norm clipping active) on 2-4
gloo ranks must give the per-step losses and every parameter (tensor-parallel shards
gathered) of a single-process run of the same model, data and seed within 1e-5. A wrong
gradient scale (a missing or extra division by a data-parallel size, a double-counted
sample, a missing encoder rescale) moves the parameters by ~1e-3 after these steps.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from core_utils.testing import run_distributed

STEPS = 5
TOL = 1e-5

LAYOUTS: dict[str, tuple[int, dict[str, dict[str, Any]], dict[str, Any]]] = {
    # encoder DP == language DP: one transfer per replica pair.
    "enc_dp2-llm_dp2": (
        4,
        {"vision": {"ranks": range(0, 2), "dp": 2}, "language": {"ranks": range(2, 4), "dp": 2}},
        {},
    ),
    # fan-in into a tensor-parallel language model (encoder gradients x2).
    "enc_dp2-llm_tp2": (
        4,
        {"vision": {"ranks": range(0, 2), "dp": 2}, "language": {"ranks": range(2, 4), "tp": 2}},
        {},
    ),
    # fan-in into a single language rank, four micro-batches in flight order.
    "enc_dp2-llm_dp1-mbs2": (
        3,
        {"vision": {"ranks": range(0, 2), "dp": 2}, "language": {"ranks": [2]}},
        {"micro_batch": 2},
    ),
    # fan-out (encoder gradients x1/2).
    "enc_dp1-llm_dp2": (
        3,
        {"vision": {"ranks": [0]}, "language": {"ranks": range(1, 3), "dp": 2}},
        {},
    ),
    # tensor-parallel encoder, fan-out.
    "enc_tp2-llm_dp2": (
        4,
        {"vision": {"ranks": range(0, 2), "tp": 2}, "language": {"ranks": range(2, 4), "dp": 2}},
        {},
    ),
    # every module on every rank.
    "colocated_dp2": (
        2,
        {"vision": {"ranks": range(0, 2), "dp": 2}, "language": {"ranks": range(0, 2), "dp": 2}},
        {},
    ),
    # megatron-core's BridgeCommunicator (nccl-only) on gloo through core_utils.cuda_compat.
    "megatron-comm-enc_dp2-llm_tp2": (
        4,
        {"vision": {"ranks": range(0, 2), "dp": 2}, "language": {"ranks": range(2, 4), "tp": 2}},
        {"communicator": "megatron-compat"},
    ),
    "megatron-comm-enc_tp2-llm_dp2": (
        4,
        {"vision": {"ranks": range(0, 2), "tp": 2}, "language": {"ranks": range(2, 4), "dp": 2}},
        {"communicator": "megatron-compat"},
    ),
}

# Data-parallel sizes that are not multiples of each other (samples are paired, not ranks):
# 2 encoder replicas feed 3 language replicas; encoder gradients x2/3.
UNEVEN = (
    5,
    {"vision": {"ranks": range(0, 2), "dp": 2}, "language": {"ranks": range(2, 5), "dp": 3}},
    {"global_batch": 12, "micro_batch": 6},
)

# Per-token normalisation with a different number of loss tokens in every sample.
PER_TOKEN_LAYOUTS: dict[str, tuple[int, dict[str, dict[str, Any]]]] = {
    "enc_dp2-llm_tp2": (
        4,
        {"vision": {"ranks": range(0, 2), "dp": 2}, "language": {"ranks": range(2, 4), "tp": 2}},
    ),
    "enc_dp1-llm_dp2": (
        3,
        {"vision": {"ranks": [0]}, "language": {"ranks": range(1, 3), "dp": 2}},
    ),
}


@pytest.fixture(scope="module")
def reference(harness: SimpleNamespace) -> dict[str, Any]:
    (result,) = run_distributed(harness.reference_training, 1, STEPS, False, False, timeout=120)
    return result


@pytest.fixture(scope="module")
def per_token_reference(harness: SimpleNamespace) -> dict[str, Any]:
    (result,) = run_distributed(harness.reference_training, 1, STEPS, True, True, timeout=120)
    return result


def _mismatch(rank: int, name: str, message: str) -> str:
    return f"rank {rank} {name}: {message}"


def _assert_matches(ranks: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    ref_losses = torch.tensor(reference["losses"], dtype=torch.float64)
    ref_params: dict[str, torch.Tensor] = reference["params"]
    # Losses fall, so the comparison is over a run that actually trains.
    assert ref_losses[-1] < ref_losses[0]
    compared: set[str] = set()
    for rank, result in enumerate(ranks):
        losses = torch.tensor(result["losses"], dtype=torch.float64)
        torch.testing.assert_close(losses, ref_losses, rtol=0, atol=TOL, msg=f"rank {rank} losses")
        for name, value in result["params"].items():
            expected = ref_params[name]
            assert value.shape == expected.shape, (rank, name, value.shape, expected.shape)
            torch.testing.assert_close(
                value,
                expected,
                rtol=0,
                atol=TOL,
                msg=functools.partial(_mismatch, rank, name),
            )
            compared.add(name)
    assert compared == set(ref_params), f"parameters never compared: {set(ref_params) - compared}"


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_trains_like_a_single_process(
    layout: str, harness: SimpleNamespace, reference: dict[str, Any]
) -> None:
    world_size, desc, kwargs = LAYOUTS[layout]
    ranks = run_distributed(harness.train_layout, world_size, desc, STEPS, kwargs, timeout=180)
    _assert_matches(ranks, reference)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_dp_sizes_that_are_not_multiples_train_like_a_single_process(
    harness: SimpleNamespace,
) -> None:
    world_size, desc, kwargs = UNEVEN
    (reference,) = run_distributed(
        harness.reference_training, 1, STEPS, False, False, 12, 6, timeout=120
    )
    ranks = run_distributed(harness.train_layout, world_size, desc, STEPS, kwargs, timeout=180)
    _assert_matches(ranks, reference)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", list(PER_TOKEN_LAYOUTS))
def test_per_token_loss_with_uneven_masks_matches_a_single_process(
    layout: str, harness: SimpleNamespace, per_token_reference: dict[str, Any]
) -> None:
    world_size, desc = PER_TOKEN_LAYOUTS[layout]
    kwargs = {"per_token_loss": True, "variable_mask": True}
    ranks = run_distributed(harness.train_layout, world_size, desc, STEPS, kwargs, timeout=180)
    _assert_matches(ranks, per_token_reference)
