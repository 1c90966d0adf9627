"""On-disk layout of a checkpoint directory: names, the tracker, completeness, validation.

A save directory holds::

    <save>/
      latest_checkpointed_iteration.txt   tracker: the newest committed iteration (written last)
      checkpoint.lock                     flock of the run writing here (see lock.py)
      iter_0000020/                       one complete checkpoint per saved iteration
        checkpoint_complete.json          completion marker (written after every shard)
        run_config.yaml                   the run's configuration
        metadata.json, .metadata, __*.distcp   megatron-core dist_checkpointing (torch_dist)
      iter_0000030.tmp/                   a save in progress (never loaded, removed later)
      iter_0000010.damaged/               a damaged checkpoint moved aside by a re-save (kept)
      non_persistent/                     global non-persistent checkpoints (same layout)
      progress.txt, run_config.yaml,      written by the training loop and fault tolerance
      ft_state.json, metrics.jsonl

The tracker is the commit point: a checkpoint counts once its directory carries the marker
and the tracker names an iteration at least as new as it.

Which checkpoint a directory resumes (:func:`find_latest_checkpoint`, with the tracker
fallback) is wanted several times in one launch: by the launch checks (``bridge-train``'s
and ``pretrain``'s own), by the run-plan notices and by the load. Inside
:func:`one_lookup_per_launch` (``bridge-train``, ``pretrain`` and ``pretrain_mimo`` run in
it) each directory is looked up once and the answer, or the error, handed to every later
asker; the tracker fallback's error line is logged once (other lookups about a checkpoint
directory, such as the resume checks' read of its ``run_config.yaml``, are kept the same
way through :func:`once_per_launch`). An answer is dropped when the directory changes
under it: a commit (this process's :func:`write_tracker`, or any process's: the tracker is
replaced by a rename, which changes the tracker's inode and the directory's modification
time, both compared on every reuse) is never hidden.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bridge.config.atomic_files import atomic_write
from bridge.train.checkpointing.errors import CheckpointError
from bridge.train.checkpointing.lock import LOCK_FILENAME

__all__ = [
    "MARKER_FILENAME",
    "NON_PERSISTENT_SUBDIR",
    "PROFILE_SUBDIR",
    "RUN_CONFIG_FILENAME",
    "RUN_FILES",
    "TRACKER_FILENAME",
    "CheckpointLocation",
    "checkpoint_dir_name",
    "complete_iterations",
    "find_latest_checkpoint",
    "is_complete_checkpoint",
    "locate_checkpoint",
    "older_complete",
    "once_per_launch",
    "one_lookup_per_launch",
    "read_marker",
    "read_tracker",
    "retired_path",
    "staging_path",
    "validate_save_dir",
    "write_tracker",
]

logger = logging.getLogger(__name__)
# Tracker fallbacks already reported (outside a launch too: bridge-convert and generation
# look a directory up, then load it); cleared when a launch starts, so each launch says it.
_REPORTED_FALLBACKS: set[tuple[str, int, int]] = set()

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
MARKER_FILENAME = "checkpoint_complete.json"
RUN_CONFIG_FILENAME = "run_config.yaml"
PROGRESS_FILENAME = "progress.txt"
NON_PERSISTENT_SUBDIR = "non_persistent"
STAGING_SUFFIX = ".tmp"
RETIRED_SUFFIX = ".old"
#: Suffix of a damaged checkpoint moved aside when its iteration is saved again (kept).
DAMAGED_SUFFIX = ".damaged"

_ITER_RE = re.compile(r"^iter_(\d{7,})$")
# Files a bridge-train run writes next to its checkpoints: the progress log, the config,
# fault tolerance's computed timeouts and the metrics file.
RUN_FILES = frozenset({PROGRESS_FILENAME, RUN_CONFIG_FILENAME, "ft_state.json", "metrics.jsonl"})
_ALLOWED_FILES = RUN_FILES | {TRACKER_FILENAME, LOCK_FILENAME}
#: Where the torch profiler writes its traces when no TensorBoard directory is set.
PROFILE_SUBDIR = "profile"
_ALLOWED_DIRS = {NON_PERSISTENT_SUBDIR, PROFILE_SUBDIR}


def checkpoint_dir_name(iteration: int) -> str:
    """``iter_0000020`` for iteration 20 (megatron's naming, zero-padded to 7 digits)."""
    return f"iter_{iteration:07d}"


def parse_iteration(name: str) -> int | None:
    """The iteration of a checkpoint directory name, or ``None`` for any other name."""
    match = _ITER_RE.match(name)
    return int(match.group(1)) if match else None


def staging_path(root: str | os.PathLike[str], iteration: int) -> Path:
    """Where a save of ``iteration`` is written before it is complete."""
    return Path(root) / (checkpoint_dir_name(iteration) + STAGING_SUFFIX)


def retired_path(root: str | os.PathLike[str], iteration: int) -> Path:
    """Where a complete checkpoint is moved while an equal-iteration replacement takes its place."""
    return Path(root) / (checkpoint_dir_name(iteration) + RETIRED_SUFFIX)


def read_marker(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The completion marker of the checkpoint directory ``path``, or ``None`` if it has none."""
    marker = Path(path) / MARKER_FILENAME
    try:
        data = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # missing, or torn or unreadable: "not complete"
    return data if isinstance(data, dict) else None


def is_complete_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a checkpoint directory whose save completed on every rank."""
    return read_marker(path) is not None


def write_marker(path: str | os.PathLike[str], content: dict[str, Any]) -> None:
    """Write the completion marker into the checkpoint directory ``path`` (atomically)."""
    atomic_write(Path(path) / MARKER_FILENAME, json.dumps(content, indent=2, sort_keys=True))


def read_tracker(root: str | os.PathLike[str]) -> int | None:
    """The iteration the tracker of ``root`` names, or ``None`` if there is no tracker.

    Raises:
        CheckpointError: The tracker exists but does not hold an iteration number.
    """
    tracker = Path(root) / TRACKER_FILENAME
    try:
        text = tracker.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"cannot read the checkpoint tracker {tracker}: {exc}") from None
    if text == "release":
        raise CheckpointError(
            f"{tracker} says 'release' (a megatron release checkpoint); bridge-train loads "
            "torch_dist checkpoints saved per iteration: point checkpoint.load at a directory "
            "written by bridge-train"
        )
    try:
        iteration = int(text)
    except ValueError:
        raise CheckpointError(
            f"{tracker} should hold an iteration number but holds {text[:80]!r}; fix or "
            "delete the file (the iter_* directories next to it are the checkpoints)"
        ) from None
    if iteration < 0:
        raise CheckpointError(f"{tracker} holds a negative iteration ({iteration})")
    return iteration


def write_tracker(root: str | os.PathLike[str], iteration: int) -> None:
    """Commit ``iteration`` as the newest checkpoint of ``root`` (atomic, durable)."""
    atomic_write(Path(root) / TRACKER_FILENAME, f"{iteration}\n")
    if _LAUNCH_LOOKUPS is not None:
        _LAUNCH_LOOKUPS.clear()  # the launch's answers predate this commit


@dataclass(frozen=True)
class _Lookup:
    stamp: tuple[tuple[int, int, int] | None, ...]  # the directory's _stats when looked up
    value: Any
    error: CheckpointError | None
    # The markers of the checkpoints the answer names, as they were: deleting or rewriting
    # one by hand changes no stamp of the directory above it.
    markers: tuple[tuple[int, int, int] | None, ...] = ()


# The answers of the running launch (see one_lookup_per_launch): (what, directory, step) ->
# its lookup; None outside a launch, where every call looks again.
_LAUNCH_LOOKUPS: dict[tuple[str, str, int | None], _Lookup] | None = None


@contextlib.contextmanager
def one_lookup_per_launch() -> Iterator[None]:
    """Inside it, each directory's checkpoint lookup runs once (see the module docstring).

    Usable as a decorator (``@one_lookup_per_launch()``); a nested use shares the enclosing
    launch's answers. Leaving the outermost one forgets them.
    """
    global _LAUNCH_LOOKUPS
    if _LAUNCH_LOOKUPS is not None:
        yield
        return
    _LAUNCH_LOOKUPS = {}
    _REPORTED_FALLBACKS.clear()
    try:
        yield
    finally:
        _LAUNCH_LOOKUPS = None


def _stats(paths: Iterable[Path]) -> tuple[tuple[int, int, int] | None, ...]:
    stamp: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            info = path.stat()
        except OSError:
            stamp.append(None)
        else:
            stamp.append((info.st_ino, info.st_mtime_ns, info.st_size))
    return tuple(stamp)


def _named_markers(base: Path, value: Any) -> tuple[tuple[int, int, int] | None, ...]:
    """The stamps of the completion markers of the checkpoints a lookup's answer names."""
    if isinstance(value, CheckpointLocation):
        return _stats([Path(value.path) / MARKER_FILENAME])
    if isinstance(value, tuple):
        return _stats(base / checkpoint_dir_name(i) / MARKER_FILENAME for i in value)
    return ()


def once_per_launch[T](
    what: str, root: str | os.PathLike[str], step: int | None, look: Callable[[], T]
) -> T:
    """``look()``, or inside :func:`one_lookup_per_launch` its answer (or error) for this
    directory unchanged.

    The answer is kept per ``(what, root, step)`` and looked up again when ``root``, its
    tracker or a marker the answer names changed (see the module docstring); a
    :class:`CheckpointError` is kept and raised again like an answer.

    Args:
        what: What is looked up (one name per kind of lookup, e.g. ``"latest"``).
        root: The directory the answer is about.
        step: The iteration asked for, or None.
        look: The lookup itself.

    Returns:
        ``look()``'s answer, or the one this launch already had.
    """
    if _LAUNCH_LOOKUPS is None:
        return look()
    base = Path(root)
    key = (what, str(base.resolve()), step)
    # What a commit, a rename or a deletion in ``base`` changes: inode, modification time
    # and size of the directory, its tracker and (for an ``iter_*`` directory) its marker;
    # taken first: a change while looking is seen by the next asker.
    stamp = _stats((base, base / TRACKER_FILENAME, base / MARKER_FILENAME))
    found = _LAUNCH_LOOKUPS.get(key)
    if found is None or found.stamp != stamp or found.markers != _named_markers(base, found.value):
        try:
            value = look()
            found = _Lookup(stamp, value, None, _named_markers(base, value))
        except CheckpointError as exc:
            found = _Lookup(stamp, None, exc)
        _LAUNCH_LOOKUPS[key] = found
    if found.error is not None:
        raise found.error.with_traceback(None)
    return found.value


def complete_iterations(root: str | os.PathLike[str]) -> list[int]:
    """Iterations of the complete checkpoint directories under ``root``, ascending."""
    return list(once_per_launch("complete", root, None, lambda: _complete_iterations(root)))


def _complete_iterations(root: str | os.PathLike[str]) -> tuple[int, ...]:
    base = Path(root)
    if not base.is_dir():
        return ()
    return tuple(
        sorted(
            iteration
            for entry in base.iterdir()
            if (iteration := parse_iteration(entry.name)) is not None
            and entry.is_dir()
            and is_complete_checkpoint(entry)
        )
    )


@dataclass(frozen=True)
class CheckpointLocation:
    """A complete checkpoint found on disk.

    Attributes:
        iteration: The training iteration it was saved at.
        path: Its directory (``.../iter_0000020``).
    """

    iteration: int
    path: str


def older_complete(root: str | os.PathLike[str], below: int) -> tuple[CheckpointLocation, ...]:
    """The complete checkpoints of ``root`` older than iteration ``below``, newest first."""
    base = Path(root)
    return tuple(
        CheckpointLocation(i, str(base / checkpoint_dir_name(i)))
        for i in reversed(complete_iterations(base))
        if i < below
    )


def find_latest_checkpoint(
    root: str | os.PathLike[str] | None, step: int | None = None
) -> CheckpointLocation | None:
    """The checkpoint of ``root`` to resume from.

    ``root`` is a save directory (its tracker names the newest committed iteration) or one
    checkpoint directory (``iter_*`` with a completion marker). With ``step`` the checkpoint
    of that iteration is returned. If the tracker names an iteration whose directory is
    missing or incomplete, the newest complete checkpoint older than it is used and a line
    logged at error level says so. Directories without a completion marker are never
    returned, and a complete directory newer than the tracker (a save that crashed before its commit) is
    ignored.

    Args:
        root: A save directory or a checkpoint directory; ``None`` finds nothing.
        step: Iteration to load instead of the newest.

    Returns:
        The location, or ``None`` when ``root`` holds no tracker and no checkpoint.

    Raises:
        CheckpointError: ``step`` names no complete checkpoint, or the tracker names an
            iteration and no complete checkpoint at or below it exists.
    """
    if root is None:
        return None
    return once_per_launch("latest", root, step, lambda: _find_latest(Path(root), step))


def _find_latest(base: Path, step: int | None) -> CheckpointLocation | None:
    """:func:`find_latest_checkpoint`'s lookup itself (run once per launch and directory)."""
    own_iteration = parse_iteration(base.name)
    if own_iteration is not None and base.is_dir() and (base / MARKER_FILENAME).exists():
        if not is_complete_checkpoint(base):
            raise CheckpointError(f"{base} has an unreadable completion marker")
        if step is not None and step != own_iteration:
            raise CheckpointError(
                f"checkpoint.ckpt_step={step} but {base} is the checkpoint of iteration "
                f"{own_iteration}; point the path at the save directory or drop ckpt_step"
            )
        return CheckpointLocation(own_iteration, str(base))
    if not base.is_dir():
        return None
    if step is not None:
        path = base / checkpoint_dir_name(step)
        if not is_complete_checkpoint(path):
            state = "is incomplete (no completion marker)" if path.is_dir() else "does not exist"
            raise CheckpointError(
                f"checkpoint.ckpt_step={step}: {path} {state}; complete checkpoints in {base}: "
                f"{complete_iterations(base) or 'none'}"
            )
        return CheckpointLocation(step, str(path))
    tracked = read_tracker(base)
    if tracked is None:
        return None
    path = base / checkpoint_dir_name(tracked)
    if is_complete_checkpoint(path):
        return CheckpointLocation(tracked, str(path))
    older = older_complete(base, tracked)
    state = (
        "is incomplete (its completion marker is missing or unreadable)"
        if path.is_dir()
        else "does not exist"
    )
    if not older:
        raise CheckpointError(
            f"the tracker {base / TRACKER_FILENAME} names iteration {tracked}, but {path} "
            f"{state} and {base} holds no older complete checkpoint; restore the directory, "
            "or delete the tracker to start from scratch"
        )
    reported = (str(base.resolve()), tracked, older[0].iteration)
    if reported not in _REPORTED_FALLBACKS:
        _REPORTED_FALLBACKS.add(reported)
        logger.error(  # a data-loss event: not hidden by filter_warnings
            "The tracker %s names iteration %d, but %s %s; loading the newest older complete "
            "checkpoint, iteration %d, instead (nothing was deleted).",
            base / TRACKER_FILENAME,
            tracked,
            path,
            state,
            older[0].iteration,
        )
    return older[0]


def validate_save_dir(root: str | os.PathLike[str], field: str = "checkpoint.save") -> None:
    """Refuse a save directory that holds anything but checkpoints written here.

    Allowed: ``iter_*`` directories (complete, in progress or left by a crash), the tracker
    and its temporary files, the run's own files (``progress.txt``, ``run_config.yaml``,
    ``ft_state.json``, ``metrics.jsonl``) and their ``.tmp`` twins, ``non_persistent/`` and
    ``profile/`` (torch profiler traces).
    A missing or empty directory is fine (it is created on the first save).

    Args:
        root: The directory checkpoints will be saved to.
        field: Config field that names it (for the message).

    Raises:
        CheckpointError: ``root`` is a file, or holds other entries; the message lists them.
    """
    base = Path(root)
    if base.exists() and not base.is_dir():
        raise CheckpointError(
            f"{field}={str(root)!r} is a file, not a directory; point {field} at a directory "
            "for checkpoints"
        )
    if not base.exists():
        return
    foreign = []
    for entry in sorted(base.iterdir(), key=lambda e: e.name):
        name = entry.name
        if entry.is_dir() and (name.startswith("iter_") or name in _ALLOWED_DIRS):
            continue
        if entry.is_file() and (
            name in _ALLOWED_FILES
            or (name.startswith(f".{TRACKER_FILENAME}.") and name.endswith(".tmp"))
            # a run file's temporary twin, left if a crash interrupted its atomic rewrite
            or name.removesuffix(".tmp") in RUN_FILES
        ):
            continue
        foreign.append(name + ("/" if entry.is_dir() else ""))
    if foreign:
        shown = ", ".join(foreign[:10]) + (
            f" and {len(foreign) - 10} more" if len(foreign) > 10 else ""
        )
        raise CheckpointError(
            f"{field}={str(root)!r} holds entries that are not bridge-train checkpoints: "
            f"{shown}. A save directory may only hold iter_* directories, "
            f"{TRACKER_FILENAME}, {LOCK_FILENAME}, {', '.join(sorted(RUN_FILES))} and "
            f"{NON_PERSISTENT_SUBDIR}/ and {PROFILE_SUBDIR}/; choose an empty or new directory "
            f"for {field} (nothing there is touched)"
        )


def locate_checkpoint(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """``(save directory, checkpoint directory)`` of ``path``: a save directory (its newest
    complete checkpoint, see :func:`find_latest_checkpoint`) or one complete ``iter_*``
    directory (its parent is the save directory).

    Raises:
        CheckpointError: ``path`` does not exist or holds no complete checkpoint.
    """
    directory = Path(path)
    if not directory.exists():
        raise CheckpointError(f"{directory} does not exist; give a bridge-train checkpoint")
    if is_complete_checkpoint(directory):
        return directory.parent, directory
    location = find_latest_checkpoint(str(directory))
    if location is None:
        raise CheckpointError(
            f"{directory} holds no complete bridge-train checkpoint (no tracker and no "
            "iter_* directory with a completion marker)"
        )
    return directory, Path(location.path)
