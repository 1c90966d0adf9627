"""Damaged checkpoints, two runs on one save directory, disk full and read-only saves.

Every case runs the ``bridge-train`` command's entry (``bridge.train.cli.main``, with the
built-in ``tiny_gpt`` recipe made smaller) in one forked rank, and checks what a user sees:
the exit code, that stderr / the log holds one line naming the damaged file or directory
and the fix, that no exception escaped (no traceback), and that the checkpoints on disk
are byte for byte what they were (nothing damaged is trusted, deleted or overwritten).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bridge.train import forward_step, pretrain
from bridge.train.checkpointing import CheckpointError
from bridge.train.checkpointing.lock import LOCK_FILENAME
from bridge.train.recipes import recipe_path
from core_utils.testing import run_distributed

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

OVERRIDES = (
    "train.eval_interval=null",
    "train.eval_iters=0",
    "model.num_layers=1",
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    "model.seq_length=32",
    "scheduler.lr_warmup_iters=1",
    "checkpoint.save_interval=2",
    "train.train_iters=6",
)
TRACKER = "latest_checkpointed_iteration.txt"


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` except the run lock (relative path -> digest)."""
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file() and path.name != LOCK_FILENAME
    }


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _with(args: list[str]) -> list[str]:
    """OVERRIDES with ``args`` replacing the same fields (a field may be given only once)."""
    given = {arg.split("=", 1)[0] for arg in args}
    return [o for o in OVERRIDES if o.split("=", 1)[0] not in given] + list(args)


def cli(args: list[str]) -> dict[str, Any]:
    """Run ``bridge-train`` in this process: exit code, stderr, warnings, escaped exception."""
    from bridge.train.cli import main

    handler = _Lines()
    logging.getLogger("bridge.train").addHandler(handler)
    err = io.StringIO()
    code: Any = None
    escaped = ""
    try:
        with contextlib.redirect_stderr(err):
            main([f"--config={recipe_path('tiny_gpt')}", "--no-print-config", *_with(args)])
    except SystemExit as exc:
        code = exc.code
    except BaseException as exc:  # what the command would print as a traceback
        escaped = f"{type(exc).__name__}: {exc}"
    finally:
        logging.getLogger("bridge.train").removeHandler(handler)
    errors = [line for line in err.getvalue().splitlines() if line.startswith("bridge-train:")]
    return {"code": code, "errors": errors, "warnings": handler.lines, "escaped": escaped}


def _flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    where = len(data) // 2 if offset is None else offset
    data[where] ^= 0xFF
    path.write_bytes(bytes(data))


def _set_checksum_algorithm(checkpoint: Path, algorithm: str) -> None:
    """Make the marker name a hash this version does not know (as a newer one might write)."""
    marker = checkpoint / "checkpoint_complete.json"
    record = json.loads(marker.read_text())
    record["checksum"] = algorithm
    marker.write_text(json.dumps(record))


def _shard(checkpoint: Path) -> Path:
    return sorted(checkpoint.glob("*.distcp"))[0]


def _damage_cases(rank: int, world: int, root: str) -> dict[str, Any]:
    base = Path(root) / "base"
    out: dict[str, Any] = {"root": root}
    out["base"] = cli([f"checkpoint.save={base}", "train.exit_interval=4"])
    out["base_files"] = snapshot(base)

    def case(name: str, damage: Any, *args: str, save: bool = False, sub: str = "") -> None:
        directory = Path(root) / name
        shutil.copytree(base, directory)
        damage(directory)
        before = snapshot(directory)
        result = cli(
            [
                f"checkpoint.load={directory / sub if sub else directory}",
                *([f"checkpoint.save={directory}"] if save else []),
                *args,
            ]
        )
        after = snapshot(directory)
        result["kept"] = {key: after.get(key) == digest for key, digest in before.items()}
        result["after"] = after
        result["before"] = before
        out[name] = result

    it2, it4 = "iter_0000002", "iter_0000004"
    # The newest checkpoint is damaged: the resume uses iteration 2 and says so; the run
    # saves iteration 4 again, and the damaged one is moved aside, not deleted.
    case("flipped_latest", lambda d: _flip_byte(_shard(d / it4)), save=True)
    case("truncated_latest", lambda d: _truncate(_shard(d / it4)))
    case("garbage_marker", lambda d: (d / it4 / "checkpoint_complete.json").write_text("{x"))
    case("no_marker", lambda d: (d / it4 / "checkpoint_complete.json").unlink())
    case("deleted_dir", lambda d: shutil.rmtree(d / it4))
    case("tracker_absent_iteration", lambda d: (d / TRACKER).write_text("9\n"))
    # Explicitly named checkpoints are refused, never replaced by another one.
    case("flipped_step", lambda d: _flip_byte(_shard(d / it4)), "checkpoint.ckpt_step=4")
    case(
        "empty_metadata",
        lambda d: (d / it4 / ".metadata").write_bytes(b""),
        "checkpoint.ckpt_step=4",
    )
    case("garbage_common", lambda d: (d / it4 / "common.pt").write_bytes(b"garbage" * 9))
    case("unknown_algorithm", lambda d: _set_checksum_algorithm(d / it4, "blake3"))
    case("iter_path", lambda d: _flip_byte(_shard(d / it4)), sub=it4)

    # Every checkpoint damaged: nothing is loaded, nothing is trained.
    def damage_both(directory: Path) -> None:
        _flip_byte(_shard(directory / it4))
        _flip_byte(_shard(directory / it2))

    case("all_damaged", damage_both)
    # Same tensor shapes, another architecture: refused on resume, allowed for finetuning.
    nothing = lambda d: None  # noqa: E731
    case("arch_heads", nothing, "model.num_attention_heads=8")
    case("arch_vocab", nothing, "tokenizer.vocab_size=250")
    case("arch_finetune", nothing, "model.num_attention_heads=8", "checkpoint.finetune=True")
    _lock_cases(Path(root), base, out)
    _save_fault_cases(Path(root), base, out)
    return out


def _lock_cases(root: Path, base: Path, out: dict[str, Any]) -> None:
    """A second run on a locked save directory is refused; a killed holder does not block."""
    directory = root / "locked"
    shutil.copytree(base, directory)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from bridge.train.checkpointing.lock import hold_save_dir_lock\n"
            "hold_save_dir_lock(sys.argv[1]); print('held', flush=True); time.sleep(600)",
            str(directory),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        out["holder_pid"] = holder.pid
        before = snapshot(directory)
        out["locked"] = cli([f"checkpoint.save={directory}"])
        out["locked"]["kept"] = snapshot(directory) == before
    finally:
        holder.kill()  # SIGKILL: no clean-up runs, the kernel drops the lock
        holder.wait()
    out["after_kill"] = cli([f"checkpoint.save={directory}"])


def _mount_tmpfs(path: Path, size: int) -> None:
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)


def _save_fault_cases(root: Path, base: Path, out: dict[str, Any]) -> None:
    """Disk full and a read-only file system when iteration 4 is saved; 2 is the last one."""
    it2 = base / "iter_0000002"
    size = sum(p.stat().st_size for p in it2.iterdir())
    probe = root / "mount_probe"
    try:
        _mount_tmpfs(probe, 1 << 20)
        subprocess.run(["umount", str(probe)], check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        out["mount_unavailable"] = f"mounting a tmpfs needs root (CAP_SYS_ADMIN): {exc}"
        return
    for name in ("disk_full", "read_only"):
        mount = root / name
        # Room for iteration 2 and half of another checkpoint.
        _mount_tmpfs(mount, size + size // 2 + 64 * 1024)
        try:
            shutil.copytree(it2, mount / "iter_0000002")
            (mount / TRACKER).write_text("2\n")
            before = snapshot(mount)
            if name == "disk_full":
                result = cli([f"checkpoint.save={mount}"])
            else:
                result = _pretrain_remounting_read_only(mount)
            result["kept"] = {k: snapshot(mount).get(k) == v for k, v in before.items()}
            # The last complete checkpoint still loads (nothing saved: no save directory).
            result["reload"] = cli([f"checkpoint.load={mount}", "train.train_iters=6"])
            out[name] = result
        finally:
            subprocess.run(["umount", "-l", str(mount)], check=False)


def _pretrain_remounting_read_only(mount: Path) -> dict[str, Any]:
    """``pretrain`` whose file system turns read-only at iteration 3 (before the save of 4)."""
    from bridge.config import load_config

    def step(state: Any, data_iterator: Any, model: Any) -> Any:
        if state.train_state.step == 2:
            subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        return forward_step(state, data_iterator, model)

    cfg = load_config(recipe_path("tiny_gpt"), [*OVERRIDES, f"checkpoint.save={mount}"])
    result: dict[str, Any] = {"code": None, "errors": [], "warnings": [], "escaped": ""}
    try:
        result["code"] = pretrain(cfg, step)
    except CheckpointError as exc:  # what bridge-train prints on one line, exit code 2
        result["code"] = 2
        result["errors"] = [f"bridge-train: error: {exc}"]
    except BaseException as exc:
        result["escaped"] = f"{type(exc).__name__}: {exc}"
    return result


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


@pytest.fixture(scope="module")
def damage(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("damage")
    (result,) = run_distributed(_damage_cases, 1, str(root), timeout=360)
    return result


def _assert_clean(result: dict[str, Any]) -> None:
    assert result["escaped"] == "", result  # no traceback


def test_base_run_saves_checksums(damage: dict[str, Any]) -> None:
    assert damage["base"]["code"] == 0, damage["base"]
    assert "iter_0000004/checkpoint_complete.json" in damage["base_files"]


@pytest.mark.parametrize("name", ["flipped_latest", "truncated_latest"])
def test_damaged_newest_checkpoint_falls_back_to_the_newest_that_verifies(
    damage: dict[str, Any], name: str
) -> None:
    result = damage[name]
    _assert_clean(result)
    assert result["code"] == 0, result
    said = [line for line in result["warnings"] if "is damaged (" in line]
    assert len(said) == 1, result["warnings"]
    assert ".distcp" in said[0] and "loading iteration 2" in said[0], said
    assert "nothing was deleted" in said[0]
    kept = result["kept"]
    if name == "flipped_latest":  # iteration 4 was saved again; the damaged one moved aside
        kept = {key: ok for key, ok in kept.items() if key.startswith("iter_0000002/")}
    assert kept and all(kept.values()), result["kept"]


def test_a_resaved_damaged_iteration_is_moved_aside_not_deleted(damage: dict[str, Any]) -> None:
    result = damage["flipped_latest"]
    aside = {
        key.replace(".damaged/", "/"): digest
        for key, digest in result["after"].items()
        if key.startswith("iter_0000004.damaged/")
    }
    damaged = {k: v for k, v in result["before"].items() if k.startswith("iter_0000004/")}
    assert aside == damaged  # byte for byte the damaged checkpoint, kept
    assert "iter_0000006/checkpoint_complete.json" in result["after"]
    said = [line for line in result["warnings"] if "moved to" in line]
    assert len(said) == 1 and "iter_0000004.damaged (not deleted)" in said[0], said


@pytest.mark.parametrize(
    "name", ["garbage_marker", "no_marker", "deleted_dir", "tracker_absent_iteration"]
)
def test_incomplete_or_missing_newest_checkpoint_is_named(
    damage: dict[str, Any], name: str
) -> None:
    result = damage[name]
    _assert_clean(result)
    assert result["code"] == 0, result
    said = [line for line in result["warnings"] if "The tracker" in line]
    assert len(said) == 1, result["warnings"]
    expected = 4 if name == "tracker_absent_iteration" else 2
    assert f"iteration {expected}, instead" in said[0], said
    assert all(result["kept"].values()), result["kept"]


@pytest.mark.parametrize(
    ("name", "named_file"),
    [
        ("flipped_step", ".distcp"),
        ("empty_metadata", ".metadata is empty"),
        ("all_damaged", "iter_0000004/__"),
        ("iter_path", "iter_0000004/__"),
    ],
)
def test_damaged_checkpoint_without_fallback_is_refused(
    damage: dict[str, Any], name: str, named_file: str
) -> None:
    result = damage[name]
    _assert_clean(result)
    assert result["code"] == 2, result
    assert len(result["errors"]) == 1, result
    line = result["errors"][0]
    assert named_file in line and "is damaged and is not loaded" in line, line
    assert "restore the directory from a copy" in line and "nothing was deleted" in line
    assert all(result["kept"].values()), result["kept"]


def test_a_file_added_to_a_checkpoint_is_damage(damage: dict[str, Any]) -> None:
    result = damage["garbage_common"]
    _assert_clean(result)
    assert result["code"] == 0, result
    said = [line for line in result["warnings"] if "is damaged (" in line]
    assert len(said) == 1 and "common.pt is not part of the checkpoint" in said[0], said


def test_a_marker_naming_an_unknown_checksum_algorithm_is_not_trusted(
    damage: dict[str, Any],
) -> None:
    result = damage["unknown_algorithm"]
    _assert_clean(result)
    assert result["code"] == 0, result
    said = [line for line in result["warnings"] if "is damaged (" in line]
    assert len(said) == 1, result["warnings"]
    assert "iter_0000004/checkpoint_complete.json names checksum algorithm 'blake3'" in said[0]
    assert "load it with the bridge-train that saved it" in said[0]
    assert "loading iteration 2" in said[0], said
    assert all(result["kept"].values()), result["kept"]


def test_a_second_run_on_a_locked_save_directory_is_refused(damage: dict[str, Any]) -> None:
    result = damage["locked"]
    _assert_clean(result)
    assert result["code"] == 2, result
    assert len(result["errors"]) == 1, result
    line = result["errors"][0]
    assert "locked" in line and "is in use by another run" in line, line
    assert f"pid {damage['holder_pid']} on host " in line and "choose another" in line, line
    assert result["kept"]


def test_a_killed_holder_leaves_no_stale_lock(damage: dict[str, Any]) -> None:
    result = damage["after_kill"]
    _assert_clean(result)
    assert result["code"] == 0, result


@pytest.mark.parametrize(
    ("name", "reason"),
    [("disk_full", "No space left on device"), ("read_only", "Read-only file system")],
)
def test_save_time_faults_stop_the_run_and_keep_the_last_checkpoint(
    damage: dict[str, Any], name: str, reason: str
) -> None:
    if "mount_unavailable" in damage:
        pytest.skip(damage["mount_unavailable"])  # a real small file system is the test
    result = damage[name]
    _assert_clean(result)
    assert result["code"] == 2, result
    assert len(result["errors"]) == 1, result
    line = result["errors"][0]
    assert reason in line and f"/{name}" in line, line
    assert f"iteration 2 ({damage['root']}/{name}/iter_0000002), is intact" in line, line
    assert "the last complete checkpoint, iteration 2" in line and "is intact" in line, line
    assert result["kept"] and all(result["kept"].values()), result["kept"]
    reload = result["reload"]
    _assert_clean(reload)
    assert reload["code"] == 0, reload


@pytest.mark.parametrize(
    ("name", "fragments"),
    [
        (
            "arch_heads",
            [
                "num_attention_heads (checkpoint 4, this run 8)",
                "run_config.yaml",
                "checkpoint.finetune=True",
            ],
        ),
        # A changed tokenizer is refused before the model is built, by the resume check
        # that compares the saved run config's data settings (checks/resume.py).
        (
            "arch_vocab",
            [
                "tokenizer.vocab_size (saved 256, this run 250)",
                "checkpoint.pretrained_checkpoint=",
                "checkpoint.resume_with_changes=true",
            ],
        ),
    ],
)
def test_resume_into_another_architecture_is_refused(
    damage: dict[str, Any], name: str, fragments: list[str]
) -> None:
    result = damage[name]
    _assert_clean(result)
    assert result["code"] == 2, result
    assert len(result["errors"]) == 1, result
    line = result["errors"][0]
    assert all(fragment in line for fragment in fragments), line
    assert all(result["kept"].values())


def test_finetune_loads_weights_into_another_architecture(damage: dict[str, Any]) -> None:
    result = damage["arch_finetune"]
    _assert_clean(result)
    assert result["code"] == 0, result
