"""Shared fixtures for the bridge-config tests (no megatron-core needed)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from bridge.config import ConfigContainer
from bridge.config.testing import tiny_container


@pytest.fixture
def container() -> ConfigContainer:
    """A complete small container (mock data, 10 iterations) that validates."""
    return tiny_container()


@pytest.fixture
def write_yaml(tmp_path: Path) -> Callable[[Any, str], Path]:
    """Write plain data (or raw text) to a YAML file under tmp_path and return its path."""

    def write(content: Any, name: str = "config.yaml") -> Path:
        path = tmp_path / name
        path.write_text(
            content if isinstance(content, str) else yaml.safe_dump(content, sort_keys=False)
        )
        return path

    return write


@pytest.fixture
def recipe(container: ConfigContainer, tmp_path: Path) -> Path:
    """The tiny container saved as a YAML recipe."""
    path = tmp_path / "recipe.yaml"
    container.to_yaml(path)
    return path
