"""The megatron engine's layout matrix on CPU: every layout equals one process.

megatron-core's own ``DistributedDataParallel``, ``get_megatron_optimizer`` (FP32 optimizer,
mixed-precision optimizer, distributed optimizer with overlapped grad reduce and param
gather) and pipeline schedules (1F1B, interleaved) run on gloo under
``core_utils.cuda_emulation``. For each layout, ``tests/megatron_layout_runner.py`` trains
the same tiny GPT (4 layers, layout-independent initial weights, mock data, global batch 8)
for 10 steps; the per-step lm loss and gradient norm must equal the one-process run of the
same engine within 1e-5 relative in fp32.

Tiers: the default run launches one bare process (the references) and one 2-rank group that
runs three layouts back to back; the full matrix (world sizes 2 and 4) is ``extended``.
Measured maxima are in docs/engines.md.
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

RUNNER = Path(__file__).with_name("megatron_layout_runner.py")
FP32_RTOL = 1e-5
# bf16 runs are compared with the one-process bf16 run of the same engine. Parameters and
# gradient buffers are bf16 (megatron's Float16Module, grad_reduce_in_fp32=False); the
# optimizer keeps fp32 main weights. A different layout changes the order in which bf16
# gradients are summed (data-parallel all-reduce vs. micro-batch accumulation, split
# reductions under tensor parallelism), and each bf16 rounding is worth up to 2^-8 ~ 3.9e-3
# relative; one such rounding moves the grad norm and, after the Adam step, the loss by
# about that much (measured: 3e-3 for the grad norm, 1.3e-4 for the loss, over DP=2 and
# PP=2). 1e-2 allows a few such roundings over 10 steps while still catching a wrong
# layout (a swapped or missing gradient moves the loss by > 1e-1 within a few steps).
BF16_RTOL = 1e-2

_LAUNCHER_VARIABLES = frozenset(
    {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
)


def _run_bare(out: Path, *layouts: str) -> dict[str, Any]:
    """One process launched without torchrun: the engine creates its own one-rank group."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    try:
        done = subprocess.run(
            [sys.executable, str(RUNNER), str(out), *layouts],
            capture_output=True,
            text=True,
            timeout=1200,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the one-process reference runs did not finish within 1200 s")
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads(out.read_text()))


def _run_ranks(out: Path, world_size: int, *layouts: str, timeout: float) -> dict[str, Any]:
    run_torchrun(RUNNER, world_size, [str(out), *layouts], timeout=timeout)
    return dict(json.loads(out.read_text()))


def _max_rel(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want) == 10
    return max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))


def _assert_matches(results: dict[str, Any], references: dict[str, Any]) -> None:
    for name, run in results.items():
        bf16 = "bf16" in name
        reference = references[
            "moe" if name.startswith("moe") else "single_bf16" if bf16 else "single"
        ]
        tolerance = BF16_RTOL if bf16 else FP32_RTOL
        for metric in ("losses", "grad_norms"):
            error = _max_rel(run[metric], reference[metric])
            assert error <= tolerance, (
                f"{name} {metric}: max relative difference {error:.2e} > {tolerance:.0e}\n"
                f"  got  {run[metric]}\n  want {reference[metric]}"
            )


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The one-process fp32 and bf16 runs (launched bare), computed once per module."""
    results = _run_bare(
        tmp_path_factory.mktemp("single") / "out.json", "single", "single_bf16", "moe"
    )
    fp32 = results["single"]["losses"]
    assert fp32[-1] < fp32[0], "the reference run does not learn"
    return results


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_fast_matrix_on_two_ranks(tmp_path: Path, references: dict[str, Any]) -> None:
    """Distributed optimizer with overlapped grad reduce and param gather, interleaved
    1F1B over PP=2 x VPP=2, and bf16 mixed precision over PP=2: one launch."""
    results = _run_ranks(
        tmp_path / "out.json", 2, "dp2_distopt", "pp2_vpp2", "pp2_bf16", timeout=1000
    )
    _assert_matches(results, references)


@pytest.mark.extended
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_full_matrix_on_two_ranks(tmp_path: Path, references: dict[str, Any]) -> None:
    results = _run_ranks(
        tmp_path / "out.json",
        2,
        "dp2",
        "dp2_overlap",
        "dp2_distopt",
        "tp2",
        "sp_tp2",
        "pp2",
        "pp2_vpp2",
        "dp2_bf16",
        "pp2_bf16",
        "moe_ep2",
        "moe_ep2_alltoall",
        timeout=1700,
    )
    _assert_matches(results, references)


@pytest.mark.extended
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_full_matrix_on_four_ranks(tmp_path: Path, references: dict[str, Any]) -> None:
    results = _run_ranks(
        tmp_path / "out.json",
        4,
        "tp2_pp2",
        "dp2_pp2_distopt",
        "tp2_pp2_vpp2",
        timeout=1700,
    )
    _assert_matches(results, references)
