"""Durable file-system operations on checkpoint directories (internal).

Single files are written with :func:`bridge.config.atomic_files.atomic_write`."""

from __future__ import annotations

import os
import shutil

from bridge.config.atomic_files import fsync_directory


def fsync_tree(path: str | os.PathLike[str]) -> None:
    """Flush every file and directory under ``path`` (cheap for files already synced)."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_directory(root)


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Delete a directory tree if it exists."""
    if os.path.isdir(path):
        shutil.rmtree(path)
