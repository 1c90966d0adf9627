"""atomic_write: all-or-nothing replacement, with the mode a normally created file gets."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge.config._errors import ConfigError
from bridge.config._yaml import write_new_file
from bridge.config.atomic_files import atomic_write


@pytest.fixture
def umask_027() -> Iterator[int]:
    previous = os.umask(0o027)
    try:
        yield 0o027
    finally:
        os.umask(previous)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_file_gets_the_umask_derived_mode_of_a_normal_file(
    tmp_path: Path, umask_027: int
) -> None:
    normal = tmp_path / "normal.yaml"
    normal.write_text("x: 1\n")
    atomic_write(tmp_path / "atomic.yaml", "x: 1\n")
    write_new_file(tmp_path / "config.yaml", "x: 1\n", overwrite=False)
    assert _mode(normal) == 0o640 == 0o666 & ~umask_027
    assert _mode(tmp_path / "atomic.yaml") == _mode(normal)  # mkstemp would give 0600
    assert _mode(tmp_path / "config.yaml") == _mode(normal)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "atomic.yaml",
        "config.yaml",
        "normal.yaml",
    ]


def test_replacing_keeps_the_files_mode_and_swaps_the_content(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.write_text("old")
    target.chmod(0o600)
    atomic_write(target, b'{"a": 1}')
    assert json.loads(target.read_text()) == {"a": 1} and _mode(target) == 0o600


def test_a_writer_function_receives_a_binary_file(tmp_path: Path) -> None:
    atomic_write(tmp_path / "cache.bin", lambda handle: handle.write(b"\x00\x01"))
    assert (tmp_path / "cache.bin").read_bytes() == b"\x00\x01"


def test_a_failing_writer_leaves_the_old_content_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "tracker.txt"
    target.write_text("10\n")

    def explode(handle: object) -> None:
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        atomic_write(target, explode)
    assert target.read_text() == "10\n"
    assert [p.name for p in tmp_path.iterdir()] == ["tracker.txt"]


def test_overwrite_false_never_replaces_an_existing_file(tmp_path: Path) -> None:
    target = tmp_path / "run.yaml"
    target.write_text("mine")
    with pytest.raises(FileExistsError, match=r"run\.yaml already exists"):
        atomic_write(target, "theirs", overwrite=False)
    with pytest.raises(ConfigError, match="pass overwrite=True"):
        write_new_file(target, "theirs", overwrite=False)
    assert target.read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["run.yaml"]
    atomic_write(tmp_path / "new.yaml", "fresh", overwrite=False)
    assert (tmp_path / "new.yaml").read_text() == "fresh"
