"""The MIMO example trains under torchrun on 4 CPU ranks and its loss falls."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch.distributed

from core_utils.testing import run_torchrun

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "mimo" / "train_mimo.py"


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_example_loss_falls_below_the_text_only_floor(tmp_path: Path) -> None:
    result_file = tmp_path / "result.json"
    proc = run_torchrun(
        EXAMPLE,
        4,
        ["--steps", "100", "--log-interval", "25", "--result-json", str(result_file)],
        timeout=400,
        cwd=tmp_path,
    )
    out = proc.stdout
    # Third-party notices are held back: one line on rank 0 says so, nothing else is noise.
    noise = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(noise) == 1 and "notices of torch/megatron-core held back" in noise[0], noise[:20]
    assert "text-only loss floor" in out
    # communicator="auto" on CPU: point-to-point, and the log says so.
    assert "communicator: p2p (no CUDA in use" in out
    assert "iteration    100" in out and "GFLOP/s" in out
    result = json.loads(result_file.read_text())
    losses = result["losses"]
    assert len(losses) == 100 and result["skipped_iterations"] == 0
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first / 10, (first, last)
    # Below what any model that ignores the images can reach: the captions' class tokens
    # are predicted from the vision encoder's embeddings, across the rank boundary.
    assert last < result["text_only_floor"] / 2, (last, result["text_only_floor"])


def test_example_checks_batch_sizes_before_building_process_groups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No MASTER_ADDR and no process group: had the script got as far as
    # init_process_group, it would fail there with another error.
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "--micro-batch-size", "3"])
    with pytest.raises(SystemExit) as info:
        runpy.run_path(str(EXAMPLE), run_name="__main__")
    assert info.value.code == (
        "train_mimo.py: error: micro_batch_size=3 is not divisible by module 'vision''s "
        "data-parallel size 2; use a multiple of 2"
    )
    assert not torch.distributed.is_initialized()
