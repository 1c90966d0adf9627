"""The fault-tolerance state file (computed timeouts) kept next to the checkpoints."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bridge.config.atomic_files import atomic_write

FT_STATE_FILENAME = "ft_state.json"


def ft_state_path(checkpoint_dir: str | os.PathLike[str]) -> Path:
    """Where the state file of the run saving to ``checkpoint_dir`` lives."""
    return Path(checkpoint_dir) / FT_STATE_FILENAME


def read_ft_state(path: Path) -> dict[str, Any] | None:
    """Return the saved state, or ``None`` if there is none.

    Raises:
        ValueError: The file exists but is not a JSON object (named in the message).
    """
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"fault-tolerance state file {path} is not valid JSON ({exc}); delete it to let "
            "the timeouts be computed again"
        ) from exc
    if not isinstance(data, dict):
        raise ValueError(
            f"fault-tolerance state file {path} holds {type(data).__name__}, expected a JSON "
            "object; delete it to let the timeouts be computed again"
        )
    return data


def write_ft_state(path: Path, state: Mapping[str, Any]) -> None:
    """Write ``state`` atomically: a reader sees the old file or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(state, indent=1, sort_keys=True))
