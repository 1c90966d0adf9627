"""Third-party notices printed while torch and megatron-core are imported, held back.

Importing megatron-core on a machine without Transformer Engine, Apex or CUDA prints about
seven warnings (``UserWarning: Transformer Engine and Apex are not installed``, a
``SyntaxWarning`` from its sources, torch's ``No CUDA runtime is found, using CUDA_HOME``)
before a command's own first line, once per rank; building a model logs megatron-core's
``GPTModel IS DEPRECATED``; loading a checkpoint through ``torch.distributed.checkpoint``
warns five more times. None of it is anything a user of this stack can act on.
:func:`held_notices` records such notices instead of printing them; the commands then print
one summary line on rank 0 (or every notice in full when asked), and library code logs them
at DEBUG level.

Only warnings raised from third-party files are held: a warning from this project's code
(or from a user's script outside ``site-packages``) is passed on as it is. Blocks nest: an
inner block's notices are added to the enclosing block's record, so the outermost one
reports everything once.

It lives in bridge-config, the lowest distribution that does not import torch, because the
commands must hold the notices of torch's own import, and because loading a config imports
the classes its ``_target_`` fields name (megatron-core's first of all).
"""

from __future__ import annotations

import logging
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "IMPORT_LOGGERS",
    "HeldNotices",
    "held_notices",
    "holding_notices",
    "log_held_notices",
    "print_held_notices",
    "silence_known_fallback_notices",
]

#: Loggers that write notices while torch is imported (torch formats them itself, "W1124 ...").
IMPORT_LOGGERS: tuple[str, ...] = ("torch.utils.cpp_extension",)


@dataclass(eq=False)
class HeldNotices:
    """The notices recorded by :func:`held_notices`.

    Attributes:
        lines: Each notice in full (``file:line: Category: message`` or ``logger: message``),
            once each, in the order they came.
    """

    lines: list[str] = field(default_factory=list)

    def add(self, line: str) -> None:
        """Record ``line`` unless it was recorded already."""
        if line not in self.lines:
            self.lines.append(line)

    def summary(self, how_to_see: str = "logger.logging_level=10 prints them") -> str | None:
        """One line saying what was held back, or None when nothing was.

        Args:
            how_to_see: The setting that shows them in full (the command's own).
        """
        if not self.lines:
            return None
        topics = []
        text = " ".join(self.lines)
        for needle, topic in (
            ("Transformer Engine", "Transformer Engine/Apex not installed"),
            ("Apex", "Transformer Engine/Apex not installed"),
            ("CUDA_HOME", "no CUDA runtime"),
            ("SyntaxWarning", "SyntaxWarning in megatron-core's sources"),
            ("deprecat", "deprecation notices"),
            ("DEPRECATED", "deprecation notices"),
            ("torch.distributed.checkpoint", "torch.distributed.checkpoint notes"),
        ):
            if needle in text and topic not in topics:
                topics.append(topic)
        about = f" ({', '.join(topics)})" if topics else ""
        return f"{len(self.lines)} notices of torch/megatron-core held back{about}; {how_to_see}"


# The records of the held_notices blocks open in each thread, innermost last.
_threads = threading.local()


def _open_blocks() -> list[HeldNotices]:
    blocks: list[HeldNotices] | None = getattr(_threads, "blocks", None)
    if blocks is None:
        blocks = _threads.blocks = []
    return blocks


def holding_notices() -> bool:
    """Whether a :func:`held_notices` block is open in this thread (its owner reports what
    it holds)."""
    return bool(_open_blocks())


class _Recorder(logging.Filter):
    """Records and drops the log records of ``prefixes`` below ERROR."""

    def __init__(self, held: HeldNotices, prefixes: Sequence[str]) -> None:
        super().__init__()
        self.held = held
        self.prefixes = tuple(prefixes)

    def filter(self, record: logging.LogRecord) -> bool:
        name = record.name
        if record.levelno >= logging.ERROR or not any(
            name == p or name.startswith(p + ".") for p in self.prefixes
        ):
            return True
        self.held.add(f"{name}: {record.getMessage()}")
        return False


# Files of this project that only pass torch calls on: a torch function that warns with
# ``stacklevel=2`` names the caller's line, which under core-utils' CUDA emulation (every
# megatron-core run) is the emulation's dispatch, not the code that called torch.
_PASS_THROUGH: tuple[tuple[str, ...], ...] = (("core_utils", "cuda_emulation.py"),)


def _is_own(filename: str) -> bool:
    """A warning of this project's code, or of a user's own files (not an installed package)."""
    parts = Path(filename).parts
    if "site-packages" in parts or "dist-packages" in parts:
        return False
    if any(parts[-len(tail) :] == tail for tail in _PASS_THROUGH):
        return False
    if any(part in ("bridge", "core_utils") for part in parts):
        return True
    return not filename.startswith("<")  # frozen/compiled internals are not the user's


@contextmanager
def held_notices(loggers: Sequence[str] = IMPORT_LOGGERS) -> Iterator[HeldNotices]:
    """Hold back third-party warnings, and the log records of ``loggers``, inside the block.

    Args:
        loggers: Logger names (with their children) whose records below ERROR are held, for
            example ``("torch.utils.cpp_extension", "megatron")`` around a model build.

    Yields:
        The record, filled as notices arrive. Warnings from this project's own files are
        re-issued unchanged when the block ends; in a nested block the notices also go to
        the enclosing block's record.
    """
    held = HeldNotices()
    recorder = _Recorder(held, loggers)
    # A record is filtered where it is logged (the named logger itself) and by the handlers
    # it reaches (its children's records propagate to the root's handlers, or to
    # logging.lastResort when there are none).
    targets: list[logging.Filterer] = [logging.getLogger(name) for name in loggers]
    targets += logging.getLogger().handlers
    if logging.lastResort is not None:
        targets.append(logging.lastResort)
    for target in targets:
        target.addFilter(recorder)
    blocks = _open_blocks()
    blocks.append(held)
    own: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            try:
                yield held
            finally:
                for item in caught:
                    if _is_own(item.filename):
                        own.append(item)
                    else:
                        category = item.category.__name__
                        held.add(f"{item.filename}:{item.lineno}: {category}: {item.message}")
    finally:
        del blocks[next(i for i, block in enumerate(blocks) if block is held)]
        for target in targets:
            target.removeFilter(recorder)
        if blocks:
            for line in held.lines:
                blocks[-1].add(line)
    for item in own:
        warnings.warn_explicit(item.message, item.category, item.filename, item.lineno)


def log_held_notices(held: HeldNotices, logger: logging.Logger) -> None:
    """Log what ``held`` recorded at DEBUG level, unless an enclosing block reports it.

    For library code that holds the notices of an import or a load: they stay visible to a
    user who turns on DEBUG logging, and print nothing otherwise.
    """
    if holding_notices():
        return
    for line in held.lines:
        logger.debug("held back: %s", line)


def print_held_notices(held: HeldNotices, prefix: str, *, verbose: bool, how_to_see: str) -> None:
    """A command's report of what ``held`` recorded, on stderr.

    Args:
        held: The record.
        prefix: What starts each line (``"bridge-convert: "``).
        verbose: Print every notice in full instead of one summary line.
        how_to_see: The option that prints them in full, named in the summary line.
    """
    if verbose:
        for line in held.lines:
            print(f"{prefix}notice: {line}", file=sys.stderr, flush=True)
        return
    summary = held.summary(how_to_see)
    if summary is not None:
        print(f"{prefix}{summary}", file=sys.stderr, flush=True)


# megatron-core repeats its "not installed, falling back" notice where a layer spec or an
# optimizer is built, after the imports (the held-back summary already said it), and calls
# its MIMO classes experimental on every build.
_KNOWN_NOTICES = (
    r"(Transformer Engine and )?Apex is not installed",
    r"\w+ is experimental and still under active development",
)
# megatron-core's advice about a CUDA setting, given on the first tensor-parallel step.
_CUDA_ADVICE = r"When using .* it is recommended to set the environment variable CUDA_DEVICE_"


def silence_known_fallback_notices(*, cuda: bool = True) -> None:
    """Ignore, for the rest of the process, megatron-core's notices repeated after import.

    Called by a command after it reported the held-back notices (unless they are printed in
    full), so the same notices do not reappear when the model and optimizer are built: the
    Transformer Engine / Apex fallback and the "experimental" notice of its MIMO classes.

    Args:
        cuda: Whether this process uses CUDA; without it megatron-core's advice to set
            ``CUDA_DEVICE_MAX_CONNECTIONS`` (given by every tensor-parallel rank) is
            ignored too.
    """
    patterns = [*_KNOWN_NOTICES, *(() if cuda else (_CUDA_ADVICE,))]
    for pattern in patterns:
        warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
