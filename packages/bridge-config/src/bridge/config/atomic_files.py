"""Durable, atomic replacement of a file: a reader sees the old content or the new, never a mix.

The one implementation every distribution above core-utils uses (configuration files, the
checkpoint tracker, the run's saved config, fault-tolerance state, dataset caches). It lives
here rather than in core-utils because saving a configuration must not import torch, and
importing ``core_utils`` does.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_write", "fsync_directory"]

# What open(path, "w") asks for; the kernel then applies the process's umask, so the
# file gets the mode any normally created file would (mkstemp would leave it 0600).
_NEW_FILE_MODE = 0o666


def fsync_directory(path: str | os.PathLike[str]) -> None:
    """Flush a directory's entries (a file created or renamed in it) to storage.

    Args:
        path: The directory.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create_temporary(target: Path) -> tuple[int, Path]:
    while True:
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _NEW_FILE_MODE), tmp
        except FileExistsError:
            continue


def _link_new(tmp: Path, target: Path) -> None:
    # A hard link fails if the name exists: an atomic "create, never replace".
    try:
        os.link(tmp, target)
    except FileExistsError:
        raise FileExistsError(f"{target} already exists") from None
    except OSError:
        # A file system without hard links: the best it allows is check, then rename.
        if target.exists():
            raise FileExistsError(f"{target} already exists") from None
        os.replace(tmp, target)


def atomic_write(
    path: str | os.PathLike[str],
    content: str | bytes | Callable[[BinaryIO], object],
    *,
    overwrite: bool = True,
) -> None:
    """Replace ``path`` with ``content`` atomically and durably.

    The content goes to a temporary file next to ``path``, is flushed to storage, renamed
    over ``path``, and the directory entry is flushed too, so after a crash at any point
    ``path`` holds either its old content or the new one. A new file gets the mode a
    normally created file would (``0o666`` minus the umask); a replaced file keeps its mode.

    Args:
        path: The file to write; its directory must exist.
        content: Text (written as UTF-8), bytes, or a function that writes into the binary
            file object it is given (``np.savez``, ``json.dump`` over a text wrapper, ...).
        overwrite: When False, refuse to replace an existing file: the new content appears
            only if ``path`` did not exist at the moment of the rename (no check-then-write
            race).

    Raises:
        FileExistsError: ``overwrite`` is False and ``path`` exists.
        OSError: The directory is missing or not writable, or the disk is full; nothing
            was changed and no temporary file is left behind.
    """
    target = Path(path)
    if not overwrite and target.exists():
        raise FileExistsError(f"{target} already exists")
    fd, tmp = _create_temporary(target)
    try:
        with os.fdopen(fd, "wb") as handle:
            if isinstance(content, str):
                handle.write(content.encode("utf-8"))
            elif isinstance(content, bytes):
                handle.write(content)
            else:
                content(handle)
            handle.flush()
            os.fsync(handle.fileno())
        if overwrite:
            # Replacing a file keeps its mode, as writing it in place would.
            with contextlib.suppress(FileNotFoundError):
                os.chmod(tmp, os.stat(target).st_mode & 0o7777)
            os.replace(tmp, target)
        else:
            _link_new(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_directory(target.parent)
