"""Content checksums of a checkpoint's files: recorded at save, verified before a load.

Every file of a checkpoint directory (shards, dist_checkpointing metadata, the common
state, ``run_config.yaml``) gets its size and CRC-32 recorded in the completion marker
(``checkpoint_complete.json``, key ``files``). The marker itself is not listed: it is the
record, and a torn or garbage marker already makes the directory incomplete.

CRC-32 (``zlib.crc32``, which releases the GIL) detects flipped, truncated and garbage
bytes, which is what storage and copy faults produce; it is not a defence against
deliberate tampering. It runs at about 2 GB/s per core on this kind of machine; the work
is split by file over the ranks, so each rank hashes about ``1/world`` of the checkpoint.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bridge.train.checkpointing import _dist

__all__ = [
    "CHECKSUM_ALGORITHM",
    "checksum_file",
    "checksum_files",
    "gather_problems",
    "local_problems",
    "verify_files",
]

#: Name recorded in the marker next to the per-file values.
CHECKSUM_ALGORITHM = "crc32"
_CHUNK = 8 << 20
_MARKER = "checkpoint_complete.json"  # layout.MARKER_FILENAME (layout imports this module's users)


def checksum_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Size and CRC-32 of one file: ``{"size": n, "crc32": "0x1234abcd"}``."""
    crc = 0
    size = 0
    with open(path, "rb", buffering=0) as handle:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while True:
            read = handle.readinto(buffer)
            if not read:
                break
            crc = zlib.crc32(view[:read], crc)
            size += read
    return {"size": size, CHECKSUM_ALGORITHM: f"0x{crc:08x}"}


def _my_share(names: Iterable[str]) -> list[str]:
    """The names this rank handles when a sorted list is split round-robin over the ranks."""
    rank, world = _dist.rank(), _dist.world_size()
    return [name for index, name in enumerate(sorted(names)) if index % world == rank]


def _gather(part: dict[str, Any]) -> dict[str, Any]:
    """Merge every rank's ``part`` on every rank (collective)."""
    if _dist.world_size() == 1:
        return part
    import torch.distributed as dist

    parts: list[Any] = [None] * _dist.world_size()
    dist.all_gather_object(parts, part)
    merged: dict[str, Any] = {}
    for piece in parts:
        merged.update(piece)
    return merged


def checksum_files(
    directory: str | os.PathLike[str], exclude: Iterable[str] = ()
) -> dict[str, Any]:
    """Checksums of every file in ``directory`` (collective: the files are split over ranks).

    Args:
        directory: A checkpoint directory whose shards are all written.
        exclude: File names to leave out (written later by the commit).

    Returns:
        ``{file name: {"size": ..., "crc32": ...}}`` on every rank; a file that could not
        be read has ``{"error": "<path>: <reason>"}`` instead (on every rank alike).
    """
    base = Path(directory)
    skip = set(exclude)
    names = sorted(
        entry.name for entry in base.iterdir() if entry.is_file() and entry.name not in skip
    )
    part: dict[str, Any] = {}
    for name in _my_share(names):
        try:
            part[name] = checksum_file(base / name)
        except OSError as exc:
            part[name] = {"error": f"{base / name}: {exc.strerror or exc}"}
    return _gather(part)


def _problem(base: Path, name: str, expected: dict[str, Any]) -> str | None:
    path = base / name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{path} is missing"
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror})"
    if size != expected.get("size"):
        what = "empty" if size == 0 else f"{size} bytes"
        return f"{path} is {what}, {expected.get('size')} bytes were saved (truncated or replaced)"
    try:
        found = checksum_file(path)
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror})"
    if found[CHECKSUM_ALGORITHM] != expected.get(CHECKSUM_ALGORITHM):
        return (
            f"{path} does not match its saved checksum ({CHECKSUM_ALGORITHM} "
            f"{found[CHECKSUM_ALGORITHM]}, saved {expected.get(CHECKSUM_ALGORITHM)}): its "
            "content changed after the save"
        )
    return None


def local_problems(
    directory: str | os.PathLike[str], recorded: dict[str, Any], share: bool = True
) -> dict[str, str]:
    """This rank's part of the check of ``directory`` against ``recorded`` (no collective).

    Safe to run in a thread beside other work (it reads files and hashes them; CRC-32 and
    file reads release the GIL); merge the parts with :func:`gather_problems`.

    Args:
        directory: The checkpoint directory.
        recorded: The marker's ``files`` entry.
        share: Check only this rank's round-robin share (else every file).

    Returns:
        ``{file name: one line saying what is wrong}`` for the damaged files checked here.
    """
    base = Path(directory)
    part = {}
    for name in _my_share(recorded) if share else sorted(recorded):
        expected = recorded[name]
        problem = _problem(base, name, expected if isinstance(expected, dict) else {})
        if problem is not None:
            part[name] = problem
    if not share or _dist.rank() == 0:
        # An extra file is damage too: megatron reads e.g. a stray common.pt if present.
        for entry in base.iterdir():
            if entry.name not in recorded and entry.name != _MARKER and entry.is_file():
                part[entry.name] = (
                    f"{entry} is not part of the checkpoint as saved (a file added later)"
                )
    return part


def gather_problems(part: dict[str, str]) -> list[str]:
    """Every rank's :func:`local_problems`, one line per damaged file, sorted (collective)."""
    return [line for _, line in sorted(_gather(part).items())]


def verify_files(
    directory: str | os.PathLike[str], recorded: dict[str, Any], collective: bool = True
) -> list[str]:
    """Check every file ``recorded`` lists against ``directory``.

    Args:
        directory: The checkpoint directory.
        recorded: The marker's ``files`` entry.
        collective: Split the files over the ranks (every rank calls it); else this rank
            checks them all.

    Returns:
        One line per damaged file (missing, of another size, other content, or present but
        not recorded), sorted; the same list on every rank. Empty when everything matches.
    """
    part = local_problems(directory, recorded, share=collective)
    if collective:
        return gather_problems(part)
    return [line for _, line in sorted(part.items())]
