"""One run per save directory: an exclusive ``fcntl.flock`` held for the life of the process.

Rank 0 of a run takes ``<save>/checkpoint.lock`` before anything is written there and keeps
it until the process ends. The kernel drops a ``flock`` when the last descriptor of the
open file goes away, so a run killed by any signal (or a crashed node, for a local disk)
leaves no stale lock behind; the pid and host written into the file only serve the message
the second run prints. Processes forked by the run (the asynchronous checkpoint writer,
data-loader workers) close their inherited copy at once, so a writer outliving its killed
parent cannot keep the directory locked.

``flock`` is advisory and local to one kernel on most network file systems' defaults; it
protects against two runs on one machine (or on a file system that forwards ``flock``, as
Lustre and recent NFS do).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import socket
from pathlib import Path

from bridge.train.checkpointing.errors import CheckpointError

__all__ = ["LOCK_FILENAME", "hold_save_dir_lock", "release_save_dir_locks"]

LOCK_FILENAME = "checkpoint.lock"

# Locks this process holds: resolved directory -> open descriptor.
_HELD: dict[str, int] = {}


def hold_save_dir_lock(directory: str | os.PathLike[str], field: str = "checkpoint.save") -> None:
    """Take the exclusive lock of ``directory`` for this process (created if needed).

    Taking it again in the same process is a no-op.

    Args:
        directory: The save directory.
        field: The config field naming it (for the message).

    Raises:
        CheckpointError: Another live process holds it (the message names its pid, host
            and start time), or the directory cannot be created.
    """
    base = Path(directory)
    try:
        base.mkdir(parents=True, exist_ok=True)
        key = str(base.resolve())
    except OSError as exc:
        raise CheckpointError(
            f"{field}={str(directory)!r} cannot be created: {exc.strerror or exc}; choose a "
            "writable directory"
        ) from None
    if key in _HELD:
        return
    path = base / LOCK_FILENAME
    try:
        # Read-only descriptor: holding it open does not keep the file system busy (a
        # remount read-only, an unmount check); flock works on any descriptor.
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise CheckpointError(
            f"cannot open the lock file {path}: {exc.strerror or exc}; {field} must be a "
            "writable directory"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = ""
        with contextlib.suppress(OSError):
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip()
        os.close(fd)
        raise CheckpointError(
            f"{field}={str(directory)!r} is in use by another run "
            f"({holder or 'pid and host unknown'}); two runs must not write one save "
            f"directory: wait for it to end, stop it, or choose another {field}"
        ) from None
    except OSError as exc:
        os.close(fd)
        raise CheckpointError(
            f"cannot lock {path}: {exc.strerror or exc}; the file system of {field} must "
            "support flock"
        ) from None
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    record = f"pid {os.getpid()} on host {socket.gethostname()}, since {started}\n"
    try:
        path.write_text(record, encoding="utf-8")
    except OSError as exc:
        os.close(fd)
        raise CheckpointError(
            f"cannot write the lock file {path}: {exc.strerror or exc}; {field} must be a "
            "writable directory"
        ) from None
    _HELD[key] = fd


def release_save_dir_locks() -> None:
    """Release every save-directory lock this process holds (the process's end does too)."""
    for fd in _HELD.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


# A forked child closes its copies (the parent keeps the lock).
os.register_at_fork(after_in_child=release_save_dir_locks)
