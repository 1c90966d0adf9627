"""The defect the p2p layout check refuses, shown on two ranks (megatron engine, CPU).

PP=2 with a virtual pipeline and megatron's default ``batch_p2p_comm=True`` trains without
any error on swapped activations and gradients. ``bridge-train`` refuses it at config time
(``packages/bridge-train/tests/test_layout_checks.py``); here it is forced through the
engine API and compared with one process: its losses are far off, while the accepted p2p
modes (``overlap_p2p_comm=True``; ``batch_p2p_comm=False``) match within 1e-5.

Extended tier (a bare run and a 2-rank launch); the default run keeps the config-time
refusal and the accepted PP=2 x VPP=2 layout of ``tests/test_megatron_engine_layouts.py``::

    uv run pytest tests/test_megatron_pipeline_p2p.py -m extended
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from core_utils.testing import run_torchrun

RUNNER = Path(__file__).resolve().with_name("megatron_p2p_runner.py")
_LAUNCHER_VARIABLES = frozenset(
    {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
)


def _max_rel(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want)
    return max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))


@pytest.mark.extended
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_batched_p2p_with_pp2_vpp2_trains_on_swapped_tensors(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    single = tmp_path / "single.json"
    done = subprocess.run(
        [sys.executable, str(RUNNER), str(single), "single"],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    reference = json.loads(single.read_text())["single"]
    out = tmp_path / "pp.json"
    run_torchrun(
        RUNNER, 2, [str(out), "pp2_vpp2_batched", "pp2_vpp2_overlap", "pp2_vpp2"], timeout=600
    )
    results: dict[str, Any] = json.loads(out.read_text())
    for accepted in ("pp2_vpp2_overlap", "pp2_vpp2"):
        for metric in ("losses", "grad_norms"):
            assert _max_rel(results[accepted][metric], reference[metric]) <= 1e-5, accepted
    wrong = results["pp2_vpp2_batched"]
    assert _max_rel(wrong["losses"], reference["losses"]) > 1e-2, wrong
    assert _max_rel(wrong["grad_norms"], reference["grad_norms"]) > 1e-1, wrong
