"""``setup_logging``: levels and filters of Python's ``logging`` from ``LoggerConfig``."""

from __future__ import annotations

import logging

from bridge.config import LoggerConfig

__all__ = ["setup_logging"]

PROJECT_LOGGERS: tuple[str, ...] = ("bridge", "core_utils")
"""Logger namespaces of this project; ``logging_level`` applies to them (and their children)."""

_FORMAT = "[%(asctime)s] %(levelname)s %(name)s: %(message)s"


def _is_project_logger(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in PROJECT_LOGGERS)


class WarningFilter(logging.Filter):
    """Drops WARNING records of other libraries (``LoggerConfig.filter_warnings``).

    This project's own warnings (a hang, a straggler, a signal received, a checkpoint or
    data cache problem) are kept: the filter exists to quiet third-party noise, and hiding
    those by default would leave a user unaware of a problem the run already detected.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """Keep every record that is not a warning, and this project's warnings."""
        return record.levelno != logging.WARNING or _is_project_logger(record.name)


class ModuleFilter(logging.Filter):
    """Drops records from the named loggers and their children (``modules_to_filter``).

    Args:
        modules: Logger names, e.g. ``["megatron.core.datasets"]``.
    """

    def __init__(self, modules: list[str]) -> None:
        super().__init__()
        self.modules = tuple(modules)

    def filter(self, record: logging.LogRecord) -> bool:
        """Keep records whose logger is not one of ``modules`` nor below one."""
        return not any(record.name == m or record.name.startswith(m + ".") for m in self.modules)


def _existing_loggers() -> list[logging.Logger]:
    # Placeholders stand for namespaces without a logger of their own: skip them.
    loggers = [
        v for v in list(logging.root.manager.loggerDict.values()) if isinstance(v, logging.Logger)
    ]
    return [logging.getLogger(), *loggers]


def _swap_filters(target: logging.Filterer, new: list[logging.Filter]) -> None:
    for old in [f for f in target.filters if isinstance(f, (WarningFilter, ModuleFilter))]:
        target.removeFilter(old)
    for f in new:
        target.addFilter(f)


def setup_logging(logger_cfg: LoggerConfig) -> None:
    """Apply ``logging_level``, ``set_level_for_all_loggers``, ``filter_warnings`` and
    ``modules_to_filter`` to Python's logging.

    * ``logging_level`` is set on this project's loggers (``bridge``, ``core_utils`` and
      their existing children); with ``set_level_for_all_loggers`` also on the root logger
      and every logger that exists at the time of the call.
    * ``filter_warnings`` drops WARNING records of other libraries (this project's own
      warnings are kept); ``modules_to_filter`` drops records from
      those loggers and their children. The filters go on the root logger's handlers
      (covering every logger that propagates, including ones created later) and on every
      existing logger and handler.
    * When the root logger has no handler, one writing to stderr is added so INFO
      records of this project are shown.

    Calling it again replaces the filters it installed before.

    Args:
        logger_cfg: The logger section.
    """
    level = logger_cfg.logging_level
    root = logging.getLogger()
    if not root.handlers:
        stderr_handler = logging.StreamHandler()
        stderr_handler.setFormatter(logging.Formatter(_FORMAT))
        root.addHandler(stderr_handler)
    loggers = _existing_loggers()
    if logger_cfg.set_level_for_all_loggers:
        for log in loggers:
            log.setLevel(level)
    else:
        for name in PROJECT_LOGGERS:
            logging.getLogger(name).setLevel(level)
        for log in loggers:
            if log is not root and _is_project_logger(log.name):
                log.setLevel(level)
    filters: list[logging.Filter] = []
    if logger_cfg.filter_warnings:
        filters.append(WarningFilter())
    if logger_cfg.modules_to_filter:
        filters.append(ModuleFilter(list(logger_cfg.modules_to_filter)))
    for log in loggers:
        _swap_filters(log, filters)
        for handler in log.handlers:
            _swap_filters(handler, filters)
