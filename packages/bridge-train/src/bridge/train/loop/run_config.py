"""``run_config.yaml``: the resolved config of a run, next to its checkpoints.

Written by rank 0 at the start of every launch that has ``checkpoint.save``, so the file
describes the latest launch (a resume with more iterations or another learning rate
replaces it, atomically). Each checkpoint directory also carries the config it was saved
with (``iter_*/run_config.yaml``, written by :mod:`bridge.train.checkpointing`), so the
config of every saved state stays available. ``bridge.config.ConfigContainer.from_yaml``
loads either file back.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch.distributed as dist

from bridge.config import ConfigContainer
from bridge.config.atomic_files import atomic_write
from core_utils.distributed import dist_ready, global_rank

__all__ = ["RUN_CONFIG_FILE", "run_config_text", "save_run_config"]

RUN_CONFIG_FILE = "run_config.yaml"


def save_run_config(config: ConfigContainer, *, barrier: bool = True) -> Path | None:
    """Save ``config`` as ``<checkpoint.save>/run_config.yaml`` (rank 0; see module docstring).

    Args:
        config: The run's (validated) configuration.
        barrier: Wait for every rank afterwards (collective when torch.distributed is up),
            so no rank starts training before the file exists.

    Returns:
        The file on rank 0 when a save directory is configured, else ``None``.
    """
    checkpoint: Any = config.checkpoint
    save = None if checkpoint is None else checkpoint.save
    path: Path | None = None
    if save is not None and global_rank() == 0:
        directory = Path(save)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / RUN_CONFIG_FILE
        text = run_config_text(config)
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            atomic_write(path, text)
    if barrier and dist_ready():
        dist.barrier()
    return path


def run_config_text(config: ConfigContainer) -> str:
    """The text ``ConfigContainer.to_yaml`` writes (loads back with ``from_yaml``): what
    ``run_config.yaml`` holds and ``bridge-train --print-config`` prints."""

    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / RUN_CONFIG_FILE
        config.to_yaml(target)
        return target.read_text(encoding="utf-8")
