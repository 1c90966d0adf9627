"""Third-party notices printed while torch and megatron-core are imported, held back.

Importing megatron-core on a machine without Transformer Engine, Apex or CUDA prints about
seven lines (``UserWarning: Transformer Engine and Apex are not installed``, a
``SyntaxWarning`` from its sources, torch's ``No CUDA runtime is found, using CUDA_HOME``)
before the command's own first line, once per rank. :func:`held_notices` records them
instead; the command then prints one summary line on rank 0, or every notice in full when
the run's logging level is DEBUG.

Only warnings raised from third-party files are held: a warning from this project's code is
passed on as it is.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["HeldNotices", "held_notices", "silence_known_fallback_notices"]

# Loggers that write notices while torch is imported (torch formats them itself, "W1124 ...").
_NOISY_LOGGERS = ("torch.utils.cpp_extension",)


@dataclass
class HeldNotices:
    """The notices recorded by :func:`held_notices`.

    Attributes:
        lines: Each notice in full (``file:line: Category: message`` or the log message),
            once each, in the order they came.
    """

    lines: list[str] = field(default_factory=list)

    def summary(self) -> str | None:
        """One line saying what was held back, or None when nothing was."""
        if not self.lines:
            return None
        topics = []
        text = " ".join(self.lines)
        for needle, topic in (
            ("Transformer Engine", "Transformer Engine/Apex not installed"),
            ("Apex", "Transformer Engine/Apex not installed"),
            ("CUDA_HOME", "no CUDA runtime"),
            ("SyntaxWarning", "SyntaxWarning in megatron-core's sources"),
            ("deprecated", "deprecation notices"),
        ):
            if needle in text and topic not in topics:
                topics.append(topic)
        about = f" ({', '.join(topics)})" if topics else ""
        return (
            f"{len(self.lines)} import-time notices of torch/megatron-core held back{about}; "
            "logger.logging_level=10 prints them"
        )


class _Recorder(logging.Filter):
    def __init__(self, held: HeldNotices) -> None:
        super().__init__()
        self.held = held

    def filter(self, record: logging.LogRecord) -> bool:
        _add(self.held, f"{record.name}: {record.getMessage()}")
        return False


def _add(held: HeldNotices, line: str) -> None:
    if line not in held.lines:
        held.lines.append(line)


def _is_own(filename: str) -> bool:
    parts = Path(filename).parts
    return any(part in ("bridge", "core_utils") for part in parts) and "site-packages" not in parts


@contextmanager
def held_notices() -> Iterator[HeldNotices]:
    """Hold back third-party warnings and torch's import-time log notices inside the block.

    Yields:
        The record, filled as notices arrive; warnings from this project's own files are
        re-issued unchanged when the block ends.
    """
    held = HeldNotices()
    recorder = _Recorder(held)
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    for log in loggers:
        log.addFilter(recorder)
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
                        _add(held, f"{item.filename}:{item.lineno}: {category}: {item.message}")
    finally:
        for log in loggers:
            log.removeFilter(recorder)
    for item in own:
        warnings.warn_explicit(item.message, item.category, item.filename, item.lineno)


# megatron-core repeats its "not installed, falling back" notice where a layer spec or an
# optimizer is built, after the imports; the held-back summary already said it.
_FALLBACK_NOTICE = r"(Transformer Engine and )?Apex is not installed"


def silence_known_fallback_notices() -> None:
    """Ignore, for the rest of the process, megatron-core's repeated TE/Apex fallback notice.

    Called by the command after it reported the held-back notices (not at DEBUG level),
    so the same notice does not reappear when the model and optimizer are built.
    """
    warnings.filterwarnings("ignore", message=_FALLBACK_NOTICE, category=UserWarning)
