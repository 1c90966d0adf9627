"""Checkpoints: sharded save/load through megatron-core dist_checkpointing, async, atomic.

See ``docs/checkpoints.md`` for the on-disk layout and the guarantees.
"""

from bridge.train.checkpointing.async_save import finalize_async_saves, pending_async_saves
from bridge.train.checkpointing.context import init_checkpointing_context
from bridge.train.checkpointing.errors import CheckpointError
from bridge.train.checkpointing.layout import (
    TRACKER_FILENAME,
    CheckpointLocation,
    checkpoint_dir_name,
    find_latest_checkpoint,
    read_tracker,
)
from bridge.train.checkpointing.load import checkpoint_exists, load_checkpoint, restore_checkpoint
from bridge.train.checkpointing.save import RunConfigFile, save_checkpoint, write_checkpoint

__all__ = [
    "TRACKER_FILENAME",
    "CheckpointError",
    "CheckpointLocation",
    "RunConfigFile",
    "checkpoint_dir_name",
    "checkpoint_exists",
    "finalize_async_saves",
    "find_latest_checkpoint",
    "init_checkpointing_context",
    "load_checkpoint",
    "pending_async_saves",
    "read_tracker",
    "restore_checkpoint",
    "save_checkpoint",
    "write_checkpoint",
]
