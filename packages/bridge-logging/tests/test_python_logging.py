"""setup_logging: logging_level, set_level_for_all_loggers, filter_warnings, modules_to_filter."""

from __future__ import annotations

import io
import logging

import pytest

from bridge.config import LoggerConfig
from bridge.logging import setup_logging

pytestmark = pytest.mark.usefixtures("restore_logging")


def _capture() -> io.StringIO:
    """A handler on the root logger that records what reaches it."""
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    logging.getLogger().addHandler(handler)
    return buffer


def test_level_applies_to_project_loggers_only_by_default() -> None:
    other = logging.getLogger("thirdparty.lib")
    other.setLevel(logging.WARNING)
    child = logging.getLogger("bridge.logging.some_child")
    child.setLevel(logging.ERROR)
    setup_logging(LoggerConfig(logging_level=logging.DEBUG, filter_warnings=False))
    assert logging.getLogger("bridge").level == logging.DEBUG
    assert logging.getLogger("core_utils").level == logging.DEBUG
    assert child.level == logging.DEBUG
    assert other.level == logging.WARNING


def test_level_for_all_loggers() -> None:
    other = logging.getLogger("thirdparty.lib")
    other.setLevel(logging.WARNING)
    setup_logging(
        LoggerConfig(
            logging_level=logging.ERROR, set_level_for_all_loggers=True, filter_warnings=False
        )
    )
    assert other.level == logging.ERROR
    assert logging.getLogger().level == logging.ERROR


def test_warning_and_module_filters_drop_records_and_are_replaced_on_reapply() -> None:
    buffer = _capture()
    setup_logging(
        LoggerConfig(
            logging_level=logging.INFO,
            filter_warnings=True,
            modules_to_filter=["noisy.mod"],
            set_level_for_all_loggers=True,
        )
    )
    logging.getLogger("bridge.x").info("kept info")
    logging.getLogger("thirdparty.x").warning("dropped warning")
    logging.getLogger("bridge.x").warning("kept: the project's own warning")
    logging.getLogger("core_utils.straggler").warning("kept: core-utils' own warning")
    logging.getLogger("bridgework").warning("dropped: only a name prefix of a project logger")
    logging.getLogger("bridge.x").error("kept error")
    logging.getLogger("noisy.mod.sub").error("dropped by module")
    logging.getLogger("noisy.module").error("kept: only a name prefix, not a child")
    logging.getLogger("created.later").warning("dropped warning from a new logger")
    text = buffer.getvalue()
    assert "kept info" in text and "kept error" in text and "kept: only a name prefix" in text
    assert "kept: the project's own warning" in text and "kept: core-utils' own warning" in text
    assert "dropped" not in text

    setup_logging(LoggerConfig(filter_warnings=False, set_level_for_all_loggers=True))
    logging.getLogger("thirdparty.x").warning("now kept warning")
    logging.getLogger("noisy.mod.sub").error("now kept module")
    text = buffer.getvalue()
    assert "now kept warning" in text and "now kept module" in text


def test_a_handler_is_added_when_the_root_has_none() -> None:
    root = logging.getLogger()
    root.handlers.clear()
    setup_logging(LoggerConfig())
    assert len(root.handlers) == 1
    setup_logging(LoggerConfig())
    assert len(root.handlers) == 1
