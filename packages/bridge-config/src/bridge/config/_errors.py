"""The single error type of bridge.config and the helpers that build its messages."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

_MISSING = object()


class ConfigError(ValueError):
    """A configuration value, file or override is invalid.

    Every problem bridge.config detects (unknown field, wrong type, value out of range,
    mutually exclusive options, missing section, unreadable YAML, malformed override) is
    raised as this one type. The message names where the problem is (``train.micro_batch_size``
    once the section is known, ``TrainingConfig.micro_batch_size`` when a section is built on
    its own), the offending value and what would be valid.

    Building a section in Python with an unknown, missing, computed or positional argument
    raises a ConfigError that is also a ``TypeError`` (as Python raises for a bad call), so
    code catching either keeps working.

    Attributes:
        location: Where the problem is: a dotted path such as ``train.micro_batch_size``,
            ``TrainingConfig.micro_batch_size``, or a file path.
        detail: What is wrong and how to fix it, without the location.
    """

    def __init__(self, location: str, detail: str) -> None:
        self.location = location
        self.detail = detail
        super().__init__(f"{location}: {detail}" if location else detail)

    def within(self, prefix: str, owner: str | None = None) -> ConfigError:
        """Return the same error with its location re-rooted under ``prefix``.

        Used when a section's own check fails while the container builds it, so that
        ``TrainingConfig.micro_batch_size`` becomes ``train.micro_batch_size``.

        Args:
            prefix: The dotted path of the section in the container, e.g. ``"train"``.
            owner: The class name the location currently starts with, which is replaced.

        Returns:
            A new ConfigError with the re-rooted location (the original is the cause).
        """
        location = self.location
        if owner and (location == owner or location.startswith(owner + ".")):
            location = location[len(owner) :].lstrip(".")
        elif location == prefix or location.startswith(prefix + "."):
            return self
        joined = f"{prefix}.{location}" if prefix and location else (prefix or location)
        error = type(self)(joined, self.detail)
        error.__cause__ = self.__cause__
        return error


class ConfigArgumentError(ConfigError, TypeError):
    """A section was called with arguments its constructor does not take (see ConfigError)."""


def suggest(name: str, choices: Iterable[str]) -> str:
    """Return a ``did you mean`` hint for a misspelt name, or an empty string."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def field_error(owner: object | type, field: str, value: Any, expected: str) -> ConfigError:
    """Build the error for one bad field value of a config section.

    Args:
        owner: The section instance or class (its class name starts the location).
        field: The field name.
        value: The bad value (shown with ``repr``).
        expected: What would be valid, phrased to complete "got X; ...".

    Returns:
        The ConfigError to raise.
    """
    cls = owner if isinstance(owner, type) else type(owner)
    return ConfigError(f"{cls.__name__}.{field}", f"got {value!r}; {expected}")


def section_error(owner: object | type, detail: str) -> ConfigError:
    """Build an error about several fields of one section (e.g. mutually exclusive options)."""
    cls = owner if isinstance(owner, type) else type(owner)
    return ConfigError(cls.__name__, detail)
