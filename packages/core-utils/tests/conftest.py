"""Shared fixtures for the core-utils tests."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

import core_utils.experimental as experimental
from core_utils.straggler import StragglerDetector


@pytest.fixture
def without_megatron(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import megatron...`` fail, as in an environment without megatron-core."""
    for name in list(sys.modules):
        if name == "megatron" or name.startswith("megatron."):
            monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "megatron", None)
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", None)


@pytest.fixture
def experimental_flag(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Start with experimental mode unset (no setter call, no environment variable)."""
    monkeypatch.delenv(experimental.ENV_VAR, raising=False)
    monkeypatch.setattr(experimental, "_explicit", None)
    yield


@pytest.fixture
def straggler_detector() -> Iterator[StragglerDetector]:
    """The singleton, closed again afterwards so no state leaks into later tests."""
    detector = StragglerDetector()
    detector.close()
    yield detector
    detector.close()
