"""Content hashes of checkpoint files: segment-tree XXH3-64 recorded now, CRC-32 markers still verify."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import pytest
import xxhash

from bridge.train.checkpointing import integrity
from bridge.train.checkpointing.integrity import (
    CHECKSUM_ALGORITHM,
    VERIFIABLE_ALGORITHMS,
    checkpoint_problems,
    checksum_file,
    checksum_files,
)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A directory shaped like a checkpoint: a shard larger than one read chunk, metadata."""
    directory = tmp_path / "iter_0000002"
    directory.mkdir()
    # 8 MiB + 3 bytes: the CRC-32 must carry across the reader's 8 MiB chunks.
    (directory / "__0_0.distcp").write_bytes(bytes(range(256)) * (32 * 1024 + 1) + b"end")
    (directory / ".metadata").write_bytes(b"metadata")
    (directory / "checkpoint_complete.json").write_text("{}")
    return directory


def _reference_tree_hash(data: bytes, segment: int) -> str:
    """XXH3-64 of the XXH3-64 digests of ``segment``-byte pieces, computed in one pass."""
    pieces = [data[i : i + segment] for i in range(0, max(len(data), 1), segment)]
    return xxhash.xxh3_64(b"".join(xxhash.xxh3_64(p).digest() for p in pieces)).hexdigest()


def _problems(checkpoint: Path, recorded: dict[str, Any], algorithm: str) -> list[str]:
    """What a load finds wrong with ``checkpoint`` whose marker records ``recorded``."""
    record = {"iteration": 2, "checksum": algorithm, "files": recorded}
    (checkpoint / "checkpoint_complete.json").write_text(json.dumps(record))
    return sorted((checkpoint_problems(checkpoint, share=False) or {}).values())


def _refuse_mmap(*args: object, **kwargs: object) -> None:
    raise OSError(19, "No such device")  # what mmap of a file on a FUSE mount can give


@pytest.mark.parametrize("segment_mib", [32, 3])  # one segment; three hashed on threads
def test_checksum_file_records_size_and_the_hash_of_every_byte(
    checkpoint: Path, segment_mib: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(integrity, "_SEGMENT", segment_mib << 20)
    shard = checkpoint / "__0_0.distcp"
    data = shard.read_bytes()
    assert CHECKSUM_ALGORITHM == "xxh3_64_tree"
    expected = {
        "size": len(data),
        "xxh3_64_tree": f"0x{_reference_tree_hash(data, segment_mib << 20)}",
    }
    assert checksum_file(shard) == expected
    with monkeypatch.context() as patch:  # where files cannot be mapped they are read
        patch.setattr(integrity.mmap, "mmap", _refuse_mmap)
        assert checksum_file(shard) == expected
    assert checksum_file(shard, "crc32") == {
        "size": len(data),
        "crc32": f"0x{zlib.crc32(data):08x}",
    }
    empty = checkpoint / "empty"
    empty.write_bytes(b"")
    assert checksum_file(empty)["xxh3_64_tree"] == f"0x{_reference_tree_hash(b'', 1)}"
    assert sorted(VERIFIABLE_ALGORITHMS) == ["crc32", "xxh3_64_tree"]


@pytest.mark.parametrize("algorithm", ["xxh3_64_tree", "crc32"])
def test_a_recorded_checkpoint_verifies_and_any_change_is_named(
    checkpoint: Path, algorithm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Markers written with either algorithm (crc32: checkpoints of older bridge-train) verify."""
    monkeypatch.setattr(integrity, "_SEGMENT", 3 << 20)  # the shard is hashed on threads
    names = ["__0_0.distcp", ".metadata"]
    recorded = {name: checksum_file(checkpoint / name, algorithm) for name in names}
    assert _problems(checkpoint, recorded, algorithm) == []

    shard = checkpoint / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit, same size
    shard.write_bytes(bytes(data))
    (problem,) = _problems(checkpoint, recorded, algorithm)
    assert str(shard) in problem and f"does not match its saved checksum ({algorithm}" in problem

    shard.write_bytes(bytes(data[:-1]))
    (problem,) = _problems(checkpoint, recorded, algorithm)
    assert "truncated or replaced" in problem


def test_an_entry_without_a_known_hash_is_damage_not_trusted(checkpoint: Path) -> None:
    recorded = {
        ".metadata": {"size": 8, "md5": "0x0"},
        "__0_0.distcp": checksum_file(checkpoint / "__0_0.distcp"),
    }
    problems = _problems(checkpoint, recorded, CHECKSUM_ALGORITHM)
    assert problems == [
        f"{checkpoint / '.metadata'} has no saved checksum in the completion marker"
    ]


def test_checksum_files_covers_every_file_but_the_excluded(checkpoint: Path) -> None:
    files = checksum_files(checkpoint, exclude=["checkpoint_complete.json"])
    assert sorted(files) == [".metadata", "__0_0.distcp"]
    assert all(CHECKSUM_ALGORITHM in entry for entry in files.values())


def test_the_marker_says_what_a_load_verifies_against(checkpoint: Path) -> None:
    files = {name: checksum_file(checkpoint / name) for name in [".metadata", "__0_0.distcp"]}
    marker = checkpoint / "checkpoint_complete.json"
    record = {"iteration": 2, "checksum": CHECKSUM_ALGORITHM, "files": files}
    assert _problems(checkpoint, files, CHECKSUM_ALGORITHM) == []
    assert _problems(checkpoint, files, "crc32") == []  # a crc32 record with xxh3 entries
    marker.write_text(json.dumps({"iteration": 2}))
    assert checkpoint_problems(checkpoint) is None  # saved before checksums: nothing to check
    for bad, says in [
        ("{not json", "is unreadable or holds no file checksums"),
        (json.dumps({**record, "files": ["x"]}), "is unreadable or holds no file checksums"),
        (json.dumps({**record, "checksum": "blake3"}), "names checksum algorithm 'blake3'"),
    ]:
        marker.write_text(bad)
        (problem,) = (checkpoint_problems(checkpoint) or {}).items()
        assert problem[0] == "checkpoint_complete.json"
        assert problem[1].startswith(f"{marker} {says}")
