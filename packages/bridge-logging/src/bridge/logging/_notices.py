"""One-time INFO notices of bridge-logging (no torch import, so the writer process can use it)."""

from __future__ import annotations

import logging

logger = logging.getLogger("bridge.logging")

_notices_given: set[str] = set()


def notice_once(key: str, message: str) -> None:
    """Log ``message`` at INFO level the first time ``key`` is seen in this process.

    INFO rather than WARNING: these notices explain why a requested metric is absent on
    this machine (no CUDA, no energy counters), which is expected rather than a fault.
    """
    if key in _notices_given:
        return
    _notices_given.add(key)
    logger.info(message)
