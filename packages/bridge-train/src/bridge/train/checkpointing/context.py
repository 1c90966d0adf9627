"""Checkpoint settings checks and the per-run checkpointing context."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from bridge.config import CheckpointConfig, ConfigError
from bridge.train.checkpointing.async_save import (
    ensure_write_results_queue,
    get_async_calls_queue,
)
from bridge.train.checkpointing.errors import run_on_rank0
from bridge.train.checkpointing.layout import NON_PERSISTENT_SUBDIR, validate_save_dir
from bridge.train.checkpointing.lock import hold_save_dir_lock
from core_utils.distributed import dist_ready

__all__ = [
    "check_checkpoint_config",
    "init_checkpointing_context",
    "non_persistent_dir",
    "required_checkpoint_section",
]


def non_persistent_dir(checkpoint_config: CheckpointConfig, base: str | None = None) -> str | None:
    """Directory of global non-persistent checkpoints.

    ``non_persistent_global_ckpt_dir`` when set, else ``<base>/non_persistent`` where
    ``base`` defaults to ``checkpoint.save``.
    """
    if checkpoint_config.non_persistent_global_ckpt_dir:
        return str(checkpoint_config.non_persistent_global_ckpt_dir)
    base = checkpoint_config.save if base is None else base
    return os.path.join(base, NON_PERSISTENT_SUBDIR) if base else None


def check_checkpoint_config(checkpoint_config: CheckpointConfig) -> None:
    """Refuse checkpoint settings this trainer cannot honour, naming the field and the fix.

    Raises:
        ConfigError: ``ckpt_format='zarr'``; non-persistent type ``local`` or
            ``in_memory`` (or a local checkpoint's directory or algorithm set);
            ``ckpt_convert_format``, ``ckpt_convert_save`` or ``use_checkpoint_args`` set;
            ``fully_parallel_load`` on a machine without CUDA.
    """
    cfg = checkpoint_config
    if cfg.ckpt_format != "torch_dist":
        raise ConfigError(
            "checkpoint.ckpt_format",
            f"{cfg.ckpt_format!r} is not supported: megatron-core 0.19 has no zarr backend "
            "(it was removed); use ckpt_format='torch_dist'",
        )
    kind = cfg.non_persistent_ckpt_type
    if kind in ("local", "in_memory"):
        raise ConfigError(
            "checkpoint.non_persistent_ckpt_type",
            f"{kind!r} is not supported: local and in-memory checkpoints need "
            "nvidia-resiliency-ext's local checkpointing, which cannot be installed next to "
            "megatron-core 0.19 here; use non_persistent_ckpt_type='global'",
        )
    # Fields that only serve the unsupported features above: a value other than the field's
    # default would be ignored.
    defaults = {f.name: f.default for f in dataclasses.fields(CheckpointConfig)}
    for why, names in (
        (
            "local checkpoints are not supported (see non_persistent_ckpt_type)",
            ("non_persistent_local_ckpt_dir", "non_persistent_local_ckpt_algo"),
        ),
        (
            "converting checkpoints is not supported; bridge-train reads and writes "
            "torch_dist only",
            ("ckpt_convert_format", "ckpt_convert_save"),
        ),
    ):
        for name in names:
            value = getattr(cfg, name)
            if value != defaults[name]:
                raise ConfigError(f"checkpoint.{name}", f"{value!r}: {why}, so unset {name}")
    if cfg.use_checkpoint_args:
        raise ConfigError(
            "checkpoint.use_checkpoint_args",
            "True is not supported by the trainer; every checkpoint stores its config as "
            "run_config.yaml: start from it with ConfigContainer.from_yaml (or "
            "bridge-train <that file>) instead",
        )
    if cfg.fully_parallel_load and not torch.cuda.is_available():
        raise ConfigError(
            "checkpoint.fully_parallel_load",
            "True requires CUDA (megatron-core exchanges the loaded shards through CUDA "
            "tensors); set fully_parallel_load=False on CPU",
        )


def init_checkpointing_context(checkpoint_config: CheckpointConfig) -> dict[str, Any]:
    """Check the checkpoint settings and the save directory; prepare saving for this rank.

    Call once per rank after torch.distributed is initialised and before training starts:
    it refuses unsupported settings and a save directory holding anything but checkpoints,
    takes that directory's lock for the process on rank 0 (see
    :mod:`~bridge.train.checkpointing.lock`), and forks this rank's helpers for saving
    (dist_checkpointing's write-results queue; the persistent asynchronous writer on CPU).

    Args:
        checkpoint_config: The ``CheckpointConfig`` (``cfg.checkpoint``).

    Returns:
        The context to pass to ``save_checkpoint`` / ``load_checkpoint``: ``config``, the
        save strategy kept between saves (``ckpt_assume_constant_structure``) and the
        fingerprint of the last saved structure.

    Raises:
        ConfigError: An unsupported setting (see :func:`check_checkpoint_config`).
        CheckpointError: ``checkpoint.save`` (or the non-persistent directory) holds
            entries that are not checkpoints, is a file, or is locked by another run.
    """
    if checkpoint_config is None:
        raise ConfigError("checkpoint", "init_checkpointing_context needs a CheckpointConfig")
    check_checkpoint_config(checkpoint_config)

    def validate() -> None:
        if checkpoint_config.save:
            validate_save_dir(checkpoint_config.save, "checkpoint.save")
            hold_save_dir_lock(checkpoint_config.save, "checkpoint.save")
        if checkpoint_config.non_persistent_ckpt_type == "global":
            directory = non_persistent_dir(checkpoint_config)
            if directory:
                validate_save_dir(directory, "checkpoint.non_persistent_global_ckpt_dir")
                if checkpoint_config.non_persistent_global_ckpt_dir:
                    hold_save_dir_lock(directory, "checkpoint.non_persistent_global_ckpt_dir")

    run_on_rank0(validate)
    saves = bool(checkpoint_config.save) or checkpoint_config.non_persistent_ckpt_type == "global"
    # Per-rank helpers exist only once the ranks do (a parent process that forks ranks
    # later must not create them: each rank needs its own). Saving creates them otherwise.
    if saves and dist_ready():
        ensure_write_results_queue()
        if checkpoint_config.async_save and checkpoint_config.use_persistent_ckpt_worker:
            get_async_calls_queue(persistent=True).warmup()
    return {"config": checkpoint_config, "save_strategy": None, "structure": None}


def required_checkpoint_section(checkpoint: CheckpointConfig | None) -> CheckpointConfig:
    """``checkpoint`` (a run's ``cfg.checkpoint``), or a clear error when it is missing.

    Raises:
        ConfigError: The run has no ``checkpoint`` section.
    """
    if checkpoint is None:
        raise ConfigError(
            "checkpoint",
            "state.cfg.checkpoint is not set; checkpointing needs the run's ConfigContainer "
            "with a CheckpointConfig in state.cfg",
        )
    return checkpoint
