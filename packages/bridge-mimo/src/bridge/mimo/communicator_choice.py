"""Which cross-module communicator a job uses when it asks for ``communicator="auto"``.

megatron-core's ``BridgeCommunicator`` is the preferred data path where it runs: it needs
CUDA (it creates ``nccl`` groups and allocates its buffers with
``torch.cuda.current_device()``), context parallel size 1 on both grids (it asserts so), and
an encoder and the language model whose data-parallel sizes are multiples of each other
(``build_comm_map`` pairs replica leaders by that ratio and raises otherwise). Everywhere
else ``torch.distributed`` point-to-point (:class:`~bridge.mimo.P2PModuleCommunicator`) moves
the embeddings. A colocated layout moves nothing between modules. The rule is a pure
function of the device in use and the layout, so every rank makes the same choice (building
megatron's communicator is collective).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from bridge.mimo.layout import MimoLayout

__all__ = ["CommunicatorChoice", "CommunicatorKind", "choose_communicator"]

CommunicatorKind = Literal["p2p", "megatron", "none", "custom"]
"""``"megatron"``: megatron-core's BridgeCommunicator; ``"p2p"``: torch.distributed
point-to-point; ``"none"``: a colocated layout, nothing to communicate; ``"custom"``: a
:class:`~bridge.mimo.ModuleCommunicator` object the caller passed."""


@dataclass(frozen=True)
class CommunicatorChoice:
    """The communicator picked for a job, and why (for the run's log).

    Attributes:
        kind: The communicator.
        reason: One sentence naming the fact that decided it.
    """

    kind: CommunicatorKind
    reason: str

    def describe(self) -> str:
        """``"<kind> (<reason>)"``, the form the training scripts log."""
        return f"{self.kind} ({self.reason})"


def choose_communicator(cuda: bool, layout: MimoLayout) -> CommunicatorChoice:
    """Pick the cross-module communicator for ``communicator="auto"``.

    Args:
        cuda: Whether the job runs on CUDA (CUDA is available and the process groups use
            nccl; megatron's communicator allocates its buffers on the current CUDA device).
        layout: The job's layout.

    Returns:
        ``megatron`` when CUDA is in use and every encoder's layout fits megatron-core's
        ``BridgeCommunicator`` (non-colocated, ``cp == 1``, encoder and language-model
        data-parallel sizes multiples of each other); ``none`` for a colocated layout;
        ``p2p`` otherwise. The reason names the deciding fact.
    """
    if layout.is_colocated:
        return CommunicatorChoice(
            "none", "colocated layout: every rank runs the whole model, nothing crosses ranks"
        )
    if not cuda:
        return CommunicatorChoice(
            "p2p",
            "no CUDA in use: megatron-core's BridgeCommunicator needs nccl groups and CUDA buffers",
        )
    language = layout.modules[layout.language_module]
    for name, placement in layout.modules.items():
        if placement.cp != 1:
            return CommunicatorChoice(
                "p2p",
                f"module {name!r} has cp={placement.cp}; megatron-core's BridgeCommunicator "
                f"supports cp=1 only",
            )
    for name in layout.encoder_modules:
        enc_dp, lm_dp = layout.modules[name].dp_size, language.dp_size
        if enc_dp % lm_dp and lm_dp % enc_dp:
            return CommunicatorChoice(
                "p2p",
                f"encoder {name!r} dp={enc_dp} and {layout.language_module!r} dp={lm_dp} are "
                f"not multiples of each other; megatron-core's BridgeCommunicator pairs "
                f"replicas by that ratio",
            )
    return CommunicatorChoice(
        "megatron",
        "CUDA in use and every encoder's layout fits megatron-core's BridgeCommunicator",
    )
