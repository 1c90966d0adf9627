"""One-time INFO notices of bridge-logging (no torch import, so the writer process can use it)."""

from __future__ import annotations

import logging

logger = logging.getLogger("bridge.logging")

_notices_given: set[str] = set()


def notice_once(key: str, message: str) -> None:
    """Log ``message`` at INFO level the first time ``key`` is seen in this process.

    INFO rather than WARNING: ``LoggerConfig.filter_warnings`` (on by default) drops
    WARNING records, and these notices explain why a requested metric is absent.
    """
    if key in _notices_given:
        return
    _notices_given.add(key)
    logger.info(message)
