"""docs/configuration.md is generated from the dataclasses and must match them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "docs" / "_generate_config_reference.py"


def test_committed_configuration_reference_is_up_to_date() -> None:
    spec = importlib.util.spec_from_file_location("_generate_config_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == generator.render(), (
        "stale: run `uv run python docs/_generate_config_reference.py`"
    )
    for heading in (
        "## `train`: `TrainingConfig`",
        "## `model`: any `ModelConfigProtocol`",
        "| `engine` |",
    ):
        assert heading in committed
