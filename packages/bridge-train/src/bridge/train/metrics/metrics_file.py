"""A metric backend writing one JSON object per line (``bridge-train --metrics-file``).

Each call of the metric writers becomes a line ``{"step": 10, "lm loss": 4.82, ...}``: the
same tags and values the other backends get (``lm loss``, ``learning-rate``,
``grad-norm``, ``lm loss validation``, ...), as full-precision floats. Made for scripts and
tests that need the numbers without TensorBoard. The file is appended to (a resumed run
adds its lines after the earlier ones; steps then repeat from the resumed iteration) and
line-buffered: each record reaches the operating system when it is written.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from bridge.logging import MetricWriter

__all__ = ["JsonlMetricWriter", "read_metrics_file"]


class JsonlMetricWriter(MetricWriter):
    """Append metrics to a JSON-lines file.

    Args:
        path: The file (its directory is created).

    Raises:
        OSError: The file cannot be opened for appending.
    """

    kind = "jsonl"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8", buffering=1)

    @property
    def backend(self) -> Any:
        """The open file."""
        return self._file

    def add_scalar(self, tag: str, value: Any, step: int) -> None:
        """Write ``{"step": step, tag: value}``."""
        self.log_metrics({tag: value}, step)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Write one line with every ``tag: value`` of ``metrics`` at ``step``."""
        if self._file is None:
            raise RuntimeError(f"{self.path}: the metrics file is closed")
        record = {"step": int(step), **{tag: float(value) for tag, value in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")

    def flush(self) -> None:
        """Flush the file to the operating system."""
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        """Flush and close the file (idempotent)."""
        if self._file is not None:
            self._file.close()  # flushes
            self._file = None


def read_metrics_file(path: str | os.PathLike[str]) -> list[dict[str, float]]:
    """Read every record of a metrics file written by :class:`JsonlMetricWriter`.

    Args:
        path: The file.

    Returns:
        The records in file order (each has ``step`` and the tags of one write).
    """
    with Path(path).open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
