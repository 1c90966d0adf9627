"""``megatron_layout_runner.py`` with two more layouts: PP=2 x VPP=2 with batched p2p.

``pp2_vpp2_batched`` is the combination ``bridge-train`` refuses at config time
(``model.batch_p2p_comm``, see ``bridge.train.checks.layout``), run here through the
engine API, which does not check it, to show what the refusal prevents;
``pp2_vpp2_overlap`` is what Megatron-LM selects for PP=2 with a virtual pipeline.

    torchrun --nproc-per-node=2 tests/megatron_p2p_runner.py OUT.json pp2_vpp2_batched ...
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# A sibling script (its directory is put on sys.path above), not an installed module.
import megatron_layout_runner as runner  # type: ignore[import-not-found]

_PP2_VPP2 = {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}
runner.LAYOUTS["pp2_vpp2_batched"] = (
    {**_PP2_VPP2, "batch_p2p_comm": True, "overlap_p2p_comm": False},
    {},
    {},
)
runner.LAYOUTS["pp2_vpp2_overlap"] = (
    {**_PP2_VPP2, "batch_p2p_comm": False, "overlap_p2p_comm": True},
    {},
    {},
)

if __name__ == "__main__":
    runner.main()
