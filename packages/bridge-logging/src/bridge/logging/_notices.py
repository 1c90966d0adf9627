"""One-time INFO notices of bridge-logging (no torch import, so the writer process can use it)."""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("bridge.logging")

_notices_given: set[str] = set()


def _rank() -> int:
    """This process's global rank, without importing torch (the launcher's ``RANK`` before
    a process group exists, 0 without a launcher)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def notice_once(key: str, message: str) -> None:
    """Log ``message`` at INFO level the first time ``key`` is seen in this process, on rank 0.

    INFO rather than WARNING: these notices explain why a requested metric is absent on
    this machine (no CUDA, no energy counters), which is expected rather than a fault.
    Every rank finds the same, so only rank 0 says it.
    """
    if key in _notices_given:
        return
    _notices_given.add(key)
    if _rank() == 0:
        logger.info(message)
