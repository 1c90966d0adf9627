"""The GPU acceptance run without a GPU: its wheel list and its dry mode.

``benchmarks/gpu/wheels.py`` must resolve against ``uv.lock``, never carry the GPU machine's
own torch or CUDA stack, and stay under the device tool's 64 MiB per call.
``benchmarks/gpu_acceptance.py --dry-run`` runs every row it can on this CPU at toy size and
writes the report the GPU run writes; the rows that need CUDA say so.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(relative: str, name: str) -> ModuleType:
    """A benchmark script imported by path (benchmarks/ is not a package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


wheels = _load("benchmarks/gpu/wheels.py", "gpu_acceptance_wheels")
acceptance = _load("benchmarks/gpu_acceptance.py", "gpu_acceptance_run")


def _lock() -> dict[str, dict[str, Any]]:
    data = tomllib.loads((ROOT / "uv.lock").read_text(encoding="utf-8"))
    return {p["name"]: p for p in data["package"]}


# -- the wheel list --------------------------------------------------------------------------


def test_wheel_plan_resolves_against_the_lock() -> None:
    lock = _lock()
    plan = wheels.plan()
    names = {entry.name for entry in plan}
    assert set(wheels.WORKSPACE) <= names
    for entry in plan:
        assert entry.name in lock, entry
        assert entry.version == str(lock[entry.name]["version"]), entry
        assert entry.source in ("workspace", "download", "image")
        if entry.source == "download":
            assert entry.filename is not None and entry.sha256 is not None
            urls = [w["url"] for w in lock[entry.name].get("wheels", [])]
            assert any(url.endswith("/" + entry.filename) for url in urls), entry
    by_name = {entry.name: entry for entry in plan}
    # megatron-core at the version bridge-train pins, carried as a wheel for CPython 3.12.
    pyproject = tomllib.loads(
        (ROOT / "packages/bridge-train/pyproject.toml").read_text(encoding="utf-8")
    )
    pinned = next(d for d in pyproject["project"]["dependencies"] if d.startswith("megatron-core"))
    megatron = by_name["megatron-core"]
    assert megatron.source == "download"
    assert pinned == f"megatron-core=={megatron.version}"
    assert "cp312" in megatron.filename and "x86_64" in megatron.filename


def test_wheel_plan_never_carries_the_machines_torch_or_cuda_stack() -> None:
    for entry in wheels.plan():
        assert not wheels.is_excluded(entry.name), entry
        assert entry.name != "torch" and not entry.name.startswith(("nvidia-", "cuda-", "triton"))
    assert wheels.is_excluded("torch") and wheels.is_excluded("nvidia-nccl-cu13")
    command = wheels.pip_download_command(wheels.plan(), Path("/tmp/whl"))
    assert "--no-deps" in command and "--only-binary=:all:" in command
    assert command[command.index("--python-version") + 1] == "3.12"
    assert not any(arg.startswith("torch") for arg in command)


def test_wheels_fit_one_device_call() -> None:
    """Registry wheels by the lock's sizes, workspace wheels bounded by their sources."""
    plan = wheels.plan()
    downloads = sum(entry.size for entry in plan if entry.source == "download")
    megatron = next(entry for entry in plan if entry.name == "megatron-core")
    assert megatron.size < 8 * 2**20  # 2.3 MiB: megatron-core alone is no reason to split
    # A wheel is a zip of the sources: their uncompressed size bounds it from above.
    sources = sum(
        f.stat().st_size
        for dist in wheels.WORKSPACE
        for f in (ROOT / "packages" / dist / "src").rglob("*")
        if f.is_file() and "__pycache__" not in f.parts
    )
    assert downloads + sources < wheels.LIMIT_BYTES, (downloads, sources)


def test_wheel_selection_prefers_what_runs_on_the_machine() -> None:
    rank = wheels._wheel_rank
    assert rank("omegaconf-2.4.0-py3-none-any.whl") is not None
    assert rank("x-1.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl") is not None
    assert rank("x-1.0-cp311-cp311-manylinux_2_17_x86_64.whl") is None
    assert rank("x-1.0-cp312-cp312-manylinux_2_17_aarch64.whl") is None
    assert rank("x-1.0-cp312-cp312-macosx_11_0_arm64.whl") is None
    assert rank("x-1.0-cp38-abi3-manylinux_2_28_x86_64.whl") is not None
    assert rank("x-1.0-cp312-cp312-manylinux_2_28_x86_64.whl") < rank(
        "x-1.0-cp312-cp312-manylinux_2_17_x86_64.whl"
    )


def test_training_flops_of_the_1b_shape() -> None:
    """6 FLOPs per parameter and token in the matrix products, plus attention (12 L s h)."""
    shape = acceptance.LLAMA_1B
    h, ffn, layers, s = (
        shape[k] for k in ("hidden_size", "ffn_hidden_size", "num_layers", "seq_length")
    )
    kv = shape["num_query_groups"] * shape["kv_channels"]
    matmul_params = layers * (h * (h + 2 * kv) + h * h + 3 * h * ffn) + h * 128256
    expected = 6 * matmul_params + 12 * layers * s * h
    assert math.isclose(acceptance.training_flops_per_token(shape), expected, rel_tol=1e-9)
    assert 1.2e9 < matmul_params < 1.3e9  # Llama-3.2-1B: 1.24 B with tied embeddings


def test_a_row_run_alone_has_the_whole_budget() -> None:
    row = acceptance._row_by_id("checkpoint")
    assert acceptance.row_limit(row, "gpu", 420.0, alone=False) == row.limit_s < 420.0
    assert acceptance.row_limit(row, "gpu", 420.0, alone=True) == 420.0
    assert acceptance.row_limit(row, "gpu", 100.0, alone=False) == 100.0
    assert acceptance.row_limit(row, "dry", 900.0, alone=False) == row.dry_limit_s


# -- the dry run -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("gpu-acceptance")
    scratch = tmp_path_factory.mktemp("gpu-acceptance-scratch")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/gpu_acceptance.py"),
            "--dry-run",
            "--out",
            str(out),
            "--scratch",
            str(scratch),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1000,  # the dry run has 900 s; a loaded shared machine needs it
        check=False,
    )
    assert (out / "report.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report: dict[str, Any] = json.loads((out / "report.json").read_text(encoding="utf-8"))
    report["_exit_code"] = proc.returncode
    report["_markdown"] = (out / "report.md").read_text(encoding="utf-8")
    report["_files"] = sorted(p.name for p in out.iterdir())
    report["_left_running"] = _processes_naming(scratch)
    return report


def _processes_naming(path: Path) -> list[str]:
    """Command lines of live processes that name ``path`` (a row's step and its helpers)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            line = " ".join(proc.info["cmdline"] or [])
            if str(path) in line and proc.pid != os.getpid():
                found.append(line[:200])
    return found


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dry_run_leaves_no_process_behind(dry_run: dict[str, Any]) -> None:
    # Steps leave with os._exit; their Manager servers and writers must not outlive them.
    assert dry_run["_left_running"] == []


def _rows(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["id"]: row for row in report["rows"]}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(1100)
def test_dry_run_report_has_every_row_with_a_valid_status(dry_run: dict[str, Any]) -> None:
    rows = _rows(dry_run)
    failed = {k: v["reason"] for k, v in rows.items() if v["status"] == "failed"}
    assert not failed, failed
    assert dry_run["_exit_code"] == 0
    assert list(rows) == [row.id for row in acceptance.ROWS]
    for row in dry_run["rows"]:
        assert row["status"] in acceptance.STATUSES, row
        assert row["title"] in dry_run["_markdown"]
        if row["status"] != "ran":
            assert row["reason"], row
    assert dry_run["mode"] == "dry-run"
    assert dry_run["_files"] == ["report.json", "report.md", "rows.log"]
    env = dry_run["environment"]
    assert env["torch"] and env["versions"]["megatron-core"] and env["cuda_available"] is False
    assert env["unmet_requirements"] == []
    # What needs CUDA says so; what does not, ran on this CPU.
    assert rows["cpu_vs_gpu"]["status"] == "not-run-here"
    assert "CUDA" in rows["cpu_vs_gpu"]["reason"]
    for row_id in ("default_recipe", "llama_1b", "checkpoint", "packed_sft", "lora", "host_syncs"):
        assert rows[row_id]["status"] == "ran", rows[row_id]
    if env.get("bridge_generate") is None:
        assert rows["generate"]["status"] == "not-run-here"
        assert rows["generate"]["reason"] == "bridge-generate not installed"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(1100)
def test_dry_run_rows_measure_sane_numbers(dry_run: dict[str, Any]) -> None:
    rows = {k: v.get("metrics") or {} for k, v in _rows(dry_run).items()}
    default = rows["default_recipe"]
    assert default["iterations"] == 4 and default["last_loss"] < default["first_loss"]
    assert default["tokens_per_s"] > 0

    llama = rows["llama_1b"]
    # The bare megatron-core loop and the trainer train the same model the same way.
    assert llama["trainer_vs_bare_max_rel_loss_diff"] < 1e-3
    for side in ("bare", "trainer"):
        assert (
            llama[side]["tokens_per_s"] > 0 and llama[side]["last_loss"] < llama[side]["first_loss"]
        )
    assert 0 < llama["framework_overhead_ratio"] < 10
    assert set(llama["parts_not_run"]) == {"gemm_peak", "micro_batch_probe", "bare_repeat"}
    assert llama["bare"]["losses"] == llama["trainer"]["losses"]

    ckpt = rows["checkpoint"]
    assert ckpt["checkpoint_bytes"] > 0
    assert ckpt["async_commits"] == ckpt["async_saves_planned"] == 2
    assert ckpt["async_overlap_measured"] and ckpt["async_save_blocking_seconds"] is not None
    assert ckpt["sync_save_blocked_seconds"] >= 0 and ckpt["sync_save_logged_seconds"] is not None
    assert ckpt["load_logged_seconds"] is not None
    assert ckpt["async_write_seconds"] is not None and ckpt["async_write_seconds"] > 0

    assert rows["packed_sft"]["losses"][-1] < rows["packed_sft"]["losses"][0]
    assert "thd" in rows["packed_sft"]["parts_not_run"]
    assert rows["lora"]["exit_code"] == 0 and rows["lora"]["base_exit_code"] == 0

    generate = rows["generate"]
    if generate:  # bridge-generate installed: exactly the asked-for tokens of 4 prompts
        assert generate["tokens"] == {"8": 32, "64": 256}  # JSON keys
        assert generate.get("decode_tokens_per_s", 0) > 0 or "decode_rate" in generate.get(
            "parts_not_run", {}
        )

    windows = rows["host_syncs"]["windows"]
    quiet = windows["iteration without a log line"]["host_value_requests"]
    logged = windows["iteration with a log line"]["host_value_requests"]
    assert 0 <= quiet <= logged


def test_cuda_sync_warnings_are_counted_at_the_caller_not_the_counting_wrapper() -> None:
    """The first GPU run filed all 56 synchronising calls of an iteration under
    ``host_syncs.py``'s TorchFunctionMode line (the innermost Python frame of a warning torch
    raises from C++). The count names the code that made the call."""
    steps = _load("benchmarks/gpu/steps.py", "gpu_acceptance_steps")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    host_syncs = _load("benchmarks/host_syncs.py", "host_syncs")
    # A stand-in for a torch op that warns from inside torch, as the sync debug mode does.
    torch_like: dict[str, Any] = {}
    exec(
        compile(
            f"import warnings\ndef op():\n    warnings.warn({steps._CUDA_SYNC_WARNING!r})\n",
            "/site-packages/torch/_fake_op.py",
            "exec",
        ),
        torch_like,
    )

    def optimizer_step() -> None:
        host_syncs.SyncCounter().__torch_function__(torch_like["op"], ())

    sites: dict[str, int] = {}
    with steps._counting_sync_warnings(sites):
        for _ in range(2):
            optimizer_step()
    assert len(sites) == 1, sites
    ((site, count),) = sites.items()
    assert count == 2
    assert "test_gpu_acceptance.py:" in site
    assert "(optimizer_step)" in site.split(" <- ")[0], site
    assert "host_syncs.py" not in site
