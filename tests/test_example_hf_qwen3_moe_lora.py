"""examples/hf_qwen3_moe_lora.py runs as written: a tiny Qwen3-MoE imported, finetuned
with LoRA at expert parallelism 2 on two processes (torchrun), exported and loaded in
transformers, with attention and expert weights finetuned and the router not.

Extended tier (about a minute idle: three fresh interpreters and a 2-rank torchrun); the
default tier covers the same path in packages/bridge-train/tests/test_hf_moe_training.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_qwen3_moe_lora.py"


@pytest.mark.extended
@pytest.mark.multiprocess
@pytest.mark.timeout(1500)
def test_example_imports_finetunes_exports_and_loads(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=1400,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout
    assert "loaded Qwen3MoeForCausalLM" in out, out
    changed = [line.strip() for line in out.splitlines() if line.startswith("  ")]
    assert changed and not any("gate.weight" in name for name in changed), out
    finetuned = int(out.split(" tensors finetuned")[0].rsplit(" ", 1)[-1])
    assert finetuned > 0
