"""``communicator="auto"``: megatron-core's BridgeCommunicator where it runs, p2p elsewhere.

The rule is a pure function of (CUDA in use, layout), so it is checked here for CUDA too on a
CPU-only machine; the CPU end-to-end choice (p2p, logged) is checked in test_training.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from bridge.mimo import CommunicatorChoice, MimoLayout, ModulePlacement, choose_communicator


def _layout(**modules: dict[str, Any]) -> MimoLayout:
    return MimoLayout({name: ModulePlacement(**spec) for name, spec in modules.items()})


FAN_IN_TP = _layout(
    vision={"ranks": range(0, 2), "dp": 2}, language={"ranks": range(2, 4), "tp": 2}
)
FAN_OUT = _layout(vision={"ranks": [0]}, language={"ranks": range(1, 3), "dp": 2})
TP_ENCODER = _layout(
    vision={"ranks": range(0, 2), "tp": 2}, language={"ranks": range(2, 4), "dp": 2}
)
FAN_IN_4_TO_2 = _layout(
    vision={"ranks": range(0, 4), "dp": 4}, language={"ranks": range(4, 8), "tp": 2, "dp": 2}
)
UNEVEN = _layout(vision={"ranks": range(0, 2), "dp": 2}, language={"ranks": range(2, 5), "dp": 3})
TWO_ENCODERS_ONE_UNEVEN = _layout(
    audio={"ranks": range(0, 3), "dp": 3},
    vision={"ranks": range(3, 5), "dp": 2},
    language={"ranks": range(5, 7), "dp": 2},
)
COLOCATED = _layout(
    vision={"ranks": range(0, 2), "dp": 2}, language={"ranks": range(0, 2), "dp": 2}
)


@pytest.mark.parametrize(
    "layout", [FAN_IN_TP, FAN_OUT, TP_ENCODER, FAN_IN_4_TO_2, UNEVEN, TWO_ENCODERS_ONE_UNEVEN]
)
def test_without_cuda_point_to_point_is_chosen(layout: MimoLayout) -> None:
    choice = choose_communicator(False, layout)
    assert choice == CommunicatorChoice(
        "p2p",
        "no CUDA in use: megatron-core's BridgeCommunicator needs nccl groups and CUDA buffers",
    )


@pytest.mark.parametrize("layout", [FAN_IN_TP, FAN_OUT, TP_ENCODER, FAN_IN_4_TO_2])
def test_with_cuda_megatron_is_chosen_where_its_pairing_works(layout: MimoLayout) -> None:
    choice = choose_communicator(True, layout)
    assert choice.kind == "megatron"
    assert "fits megatron-core's BridgeCommunicator" in choice.reason


def test_with_cuda_dp_sizes_that_are_not_multiples_fall_back_to_p2p() -> None:
    choice = choose_communicator(True, UNEVEN)
    assert choice.kind == "p2p"
    assert choice.reason == (
        "encoder 'vision' dp=2 and 'language' dp=3 are not multiples of each other; "
        "megatron-core's BridgeCommunicator pairs replicas by that ratio"
    )
    # One encoder that does not fit is enough: both encoders use the same communicator.
    choice = choose_communicator(True, TWO_ENCODERS_ONE_UNEVEN)
    assert choice.kind == "p2p" and "encoder 'audio' dp=3" in choice.reason


@pytest.mark.parametrize("cuda", [False, True])
def test_colocated_layouts_need_no_communicator(cuda: bool) -> None:
    choice = choose_communicator(cuda, COLOCATED)
    assert choice.kind == "none"
    assert choice.describe().startswith("none (colocated layout")


def test_with_cuda_context_parallelism_falls_back_to_p2p() -> None:
    # megatron's communicator asserts cp == 1 (bridge-mimo's own validation refuses cp > 1
    # later; the rule does not depend on that).
    layout = _layout(vision={"ranks": [0]}, language={"ranks": range(1, 3), "cp": 2})
    choice = choose_communicator(True, layout)
    assert choice.kind == "p2p"
    assert "module 'language' has cp=2" in choice.reason
