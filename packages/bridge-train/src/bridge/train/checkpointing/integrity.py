"""Content checksums of a checkpoint's files: recorded at save, verified before a load.

Every file of a checkpoint directory (shards, dist_checkpointing metadata, the common
state, ``run_config.yaml``) gets its size and a content hash recorded in the completion
marker (``checkpoint_complete.json``: key ``files``, and ``checksum`` naming the algorithm).
The marker itself is not listed: it is the record, and a torn or garbage marker already
makes the directory incomplete.

The hash (``xxh3_64_tree``) is XXH3-64 (the ``xxhash`` package, which releases the GIL) of
the XXH3-64 digests of the file's 32 MiB segments, hashed on several threads: a rank
usually writes one large shard, and one core reading and hashing it after the save cost
5-9% of the save. The files are hashed through a memory map (read where a filesystem
cannot map them), because reading copies every byte once more: 20 ms instead of 12 ms for
a 167 MB shard in the page cache on 2 cores. Like safetensors and ``torch.load(mmap=True)``,
this assumes no other process truncates a file while it is hashed (the hashing process
would die of SIGBUS): saves write into a private staging directory, and committed
checkpoints are never rewritten in place. CRC-32 (``zlib.crc32``, one pass), used by
checkpoints saved before, gave 8-11%. Both detect flipped, truncated and garbage bytes,
which is what storage and copy faults produce; neither is a defence against deliberate
tampering. Checkpoints recorded with either verify. The work is split by file over the
ranks, so each rank hashes about ``1/world`` of the checkpoint.
"""

from __future__ import annotations

import mmap
import os
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import xxhash

from bridge.train.checkpointing.layout import MARKER_FILENAME, read_marker
from core_utils.distributed import gather_from_every_rank, global_rank, global_world_size

__all__ = [
    "CHECKSUM_ALGORITHM",
    "VERIFIABLE_ALGORITHMS",
    "checkpoint_problems",
    "checksum_file",
    "checksum_files",
    "gather_problems",
]

#: Name recorded in the marker (``checksum``) and as the key of each file's hash.
CHECKSUM_ALGORITHM = "xxh3_64_tree"
_CHUNK = 8 << 20
_SEGMENT = 32 << 20  # part of the algorithm: changing it changes every recorded hash
_THREADS = 4


def _crc32(path: str | os.PathLike[str]) -> tuple[int, str]:
    """Size and CRC-32 of one file (the algorithm of checkpoints saved before)."""
    value = size = 0
    with open(path, "rb", buffering=0) as handle:
        while chunk := handle.read(_CHUNK):
            value = zlib.crc32(chunk, value)
            size += len(chunk)
    return size, f"{value:08x}"


def _tree_hash(path: str | os.PathLike[str]) -> tuple[int, str]:
    with open(path, "rb") as handle:
        fd = handle.fileno()
        size = os.fstat(fd).st_size
        try:
            mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if size else None
        except OSError:  # a filesystem without mmap support (some FUSE mounts): read
            mapping = None
        view = None if mapping is None else memoryview(mapping)
        if view is not None:
            size = len(view)  # what is hashed, should the file have changed since fstat

        def segment(start: int) -> bytes:
            if view is not None:
                return xxhash.xxh3_64(view[start : start + _SEGMENT]).digest()
            hasher = xxhash.xxh3_64()
            end = min(start + _SEGMENT, size)
            while start < end and (chunk := os.pread(fd, min(_CHUNK, end - start), start)):
                hasher.update(chunk)
                start += len(chunk)
            return hasher.digest()

        try:
            starts = range(0, max(size, 1), _SEGMENT)
            with ThreadPoolExecutor(min(len(starts), _THREADS), "checkpoint-hash") as pool:
                digests = list(pool.map(segment, starts))
        finally:
            if view is not None:
                view.release()
            if mapping is not None:
                mapping.close()
    return size, xxhash.xxh3_64(b"".join(digests)).hexdigest()


_HASHERS: dict[str, Callable[[str | os.PathLike[str]], tuple[int, str]]] = {
    "xxh3_64_tree": _tree_hash,
    "crc32": _crc32,
}

#: Algorithms a load can verify: the current one and those of older checkpoints.
VERIFIABLE_ALGORITHMS = frozenset(_HASHERS)


def checksum_file(
    path: str | os.PathLike[str], algorithm: str = CHECKSUM_ALGORITHM
) -> dict[str, Any]:
    """Size and hash of one file: ``{"size": n, "xxh3_64_tree": "0x0123456789abcdef"}``.

    Args:
        path: The file.
        algorithm: One of :data:`VERIFIABLE_ALGORITHMS` (the key of the hash).
    """
    size, digest = _HASHERS[algorithm](path)
    return {"size": size, algorithm: f"0x{digest}"}


def _my_share(names: Iterable[str]) -> list[str]:
    """The names this rank handles when a sorted list is split round-robin over the ranks."""
    rank, world = global_rank(), global_world_size()
    return [name for index, name in enumerate(sorted(names)) if index % world == rank]


def _gather(part: dict[str, Any]) -> dict[str, Any]:
    """Merge every rank's ``part`` on every rank (collective)."""
    return {name: value for piece in gather_from_every_rank(part) for name, value in piece.items()}


def checksum_files(
    directory: str | os.PathLike[str], exclude: Iterable[str] = ()
) -> dict[str, Any]:
    """Checksums of every file in ``directory`` (collective: the files are split over ranks).

    Args:
        directory: A checkpoint directory whose shards are all written.
        exclude: File names to leave out (written later by the commit).

    Returns:
        ``{file name: {"size": ..., "xxh3_64_tree": ...}}`` on every rank; a file that could not
        be read has ``{"error": "<path>: <reason>"}`` instead (on every rank alike).
    """
    base = Path(directory)
    skip = set(exclude)
    names = [e.name for e in base.iterdir() if e.is_file() and e.name not in skip]
    part: dict[str, Any] = {}
    for name in _my_share(names):  # sorted there
        try:
            part[name] = checksum_file(base / name)
        except OSError as exc:
            part[name] = {"error": f"{base / name}: {exc.strerror or exc}"}
    return _gather(part)


def _problem(path: Path, expected: dict[str, Any]) -> str | None:
    algorithm = next((name for name in _HASHERS if name in expected), None)
    try:
        size = path.stat().st_size
        if size != expected.get("size"):
            what = "empty" if size == 0 else f"{size} bytes"
            saved = expected.get("size")
            return f"{path} is {what}, {saved} bytes were saved (truncated or replaced)"
        if algorithm is None:
            return f"{path} has no saved checksum in the completion marker"
        found = checksum_file(path, algorithm)[algorithm]
    except FileNotFoundError:
        return f"{path} is missing"
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror})"
    if found != expected[algorithm]:
        return (
            f"{path} does not match its saved checksum ({algorithm} {found}, saved "
            f"{expected[algorithm]}): its content changed after the save"
        )
    return None


def gather_problems(part: dict[str, str]) -> list[str]:
    """Every rank's :func:`checkpoint_problems`, one line per damaged file, sorted (collective)."""
    return [line for _, line in sorted(_gather(part).items())]


def checkpoint_problems(
    directory: str | os.PathLike[str], share: bool = True
) -> dict[str, str] | None:
    """What is wrong with the files of ``directory`` against its own completion marker.

    No collective: safe to run in a thread beside other work (file reads and the hashes
    release the GIL). An unreadable marker or directory is a problem too.

    Args:
        directory: The checkpoint directory.
        share: Check only this rank's round-robin share (merge the parts with
            :func:`gather_problems`), else every file.

    Returns:
        ``{file name: one line saying what is wrong}``, or ``None`` for a checkpoint saved
        before checksums existed (nothing to check against).
    """
    marker = read_marker(directory)
    if marker is not None and "files" not in marker:
        return None  # saved before checksums existed
    files: Any = None if marker is None else marker.get("files")
    problem = None
    # Incomplete (a staging leftover renamed by hand, a torn marker), or not verifiable here.
    if marker is None or not isinstance(files, dict):
        problem = "is unreadable or holds no file checksums"
    elif marker.get("checksum") not in VERIFIABLE_ALGORITHMS:
        problem = (
            f"names checksum algorithm {marker.get('checksum')!r}, which this version cannot "
            f"verify (it knows {', '.join(sorted(VERIFIABLE_ALGORITHMS))}): load it with the "
            "bridge-train that saved it"
        )
    if problem is not None:
        return {MARKER_FILENAME: f"{Path(directory) / MARKER_FILENAME} {problem}"}
    base = Path(directory)
    part = {}
    try:
        for name in _my_share(files) if share else sorted(files):
            expected = files[name]
            problem = _problem(base / name, expected if isinstance(expected, dict) else {})
            if problem is not None:
                part[name] = problem
        if not share or global_rank() == 0:
            # An extra file is damage too: megatron reads e.g. a stray common.pt if present.
            for entry in base.iterdir():
                if entry.name not in files and entry.name != MARKER_FILENAME and entry.is_file():
                    part[entry.name] = (
                        f"{entry} is not part of the checkpoint as saved (a file added later)"
                    )
    except OSError as exc:
        return {str(directory): f"{directory} cannot be read ({exc.strerror or exc})"}
    return part
