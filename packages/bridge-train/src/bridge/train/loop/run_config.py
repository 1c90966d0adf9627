"""``run_config.yaml``: the resolved config of a run, next to its checkpoints.

Written by rank 0 at the start of every launch that has ``checkpoint.save``, so the file
describes the latest launch (a resume with more iterations or another learning rate
replaces it, atomically). Each checkpoint directory also carries the config it was saved
with (``iter_*/run_config.yaml``, written by :mod:`bridge.train.checkpointing`), so the
config of every saved state stays available. ``bridge.config.ConfigContainer.from_yaml``
loads either file back.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from bridge.config.atomic_files import atomic_write
from bridge.train.checkpointing.layout import RUN_CONFIG_FILENAME
from core_utils.distributed import dist_ready, global_rank

__all__ = ["save_run_config"]


def save_run_config(
    save: str | None, yaml_text: Callable[[], str], *, barrier: bool = True
) -> Path | None:
    """Write the run's resolved config as ``<save>/run_config.yaml`` on rank 0 (see the
    module docstring).

    Args:
        save: The run's ``checkpoint.save`` directory (None: nothing is written).
        yaml_text: Gives the config's YAML (``ConfigContainer.to_yaml_text``); called only
            where the file is written, so a run that saves nothing never serialises it.
        barrier: Wait for every rank afterwards (collective when torch.distributed is up),
            so no rank starts training before the file exists.

    Returns:
        The file on rank 0 when a save directory is configured, else ``None``.
    """
    path: Path | None = None
    if save is not None and global_rank() == 0:
        directory = Path(save)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / RUN_CONFIG_FILENAME
        text = yaml_text()
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            atomic_write(path, text)
    if barrier and dist_ready():
        dist.barrier()
    return path
