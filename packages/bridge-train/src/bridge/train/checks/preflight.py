"""Checks run before any process group, model or dataset exists.

:func:`check_config_before_launch` turns every problem a user can fix in the config into a
:class:`bridge.config.ConfigError` naming the field and the fix: the container's own
``validate()``, missing data files, a checkpoint directory holding something that is not
a bridge-train run, an engine, backend, profiler or rerun mode that needs CUDA on a
machine without it, and a parallel layout that does not fit the world. The ``bridge-train``
command prints these without a traceback and exits with code 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from bridge.config import ConfigContainer, ConfigError
from bridge.train.checks.finetune import check_finetuning_config
from core_utils.distributed import global_world_size

__all__ = ["check_checkpoint_directories", "check_config_before_launch"]


def check_checkpoint_directories(checkpoint: Any) -> None:
    """Refuse checkpoint settings and directories that cannot work, before anything runs.

    The checks of :mod:`bridge.train.checkpointing` (unsupported formats and settings on
    this machine; a ``checkpoint.save`` directory that holds anything but a bridge-train
    run), applied to ``checkpoint.load`` too (unless it names one checkpoint directory);
    ``checkpoint.load`` without a checkpoint is refused with
    ``checkpoint.exit_on_missing_checkpoint``; ``checkpoint.pretrained_checkpoint`` must
    hold a checkpoint.

    Args:
        checkpoint: The ``checkpoint`` section.

    Raises:
        ConfigError: The message names the field, what is there and what to do.
    """
    if all(getattr(checkpoint, name) is None for name in ("save", "load", "pretrained_checkpoint")):
        return
    from bridge.train.checkpointing import CheckpointError, checkpoint_exists
    from bridge.train.checkpointing.context import check_checkpoint_config
    from bridge.train.checkpointing.layout import validate_save_dir

    check_checkpoint_config(checkpoint)
    for field in ("save", "load"):
        path = getattr(checkpoint, field)
        if path is None or (field == "load" and checkpoint_exists(path)):
            continue
        try:
            validate_save_dir(path, f"checkpoint.{field}")
        except CheckpointError as exc:
            raise ConfigError(f"checkpoint.{field}", _without_field(str(exc), field)) from None
    load = checkpoint.load
    if load is not None and checkpoint.exit_on_missing_checkpoint and not checkpoint_exists(load):
        raise ConfigError(
            "checkpoint.load",
            f"{str(load)!r} holds no checkpoint and checkpoint.exit_on_missing_checkpoint is "
            "set; fix the path, or unset exit_on_missing_checkpoint to train from scratch",
        )
    pretrained = checkpoint.pretrained_checkpoint
    if pretrained is not None and not checkpoint_exists(pretrained):
        raise ConfigError(
            "checkpoint.pretrained_checkpoint",
            f"{str(pretrained)!r} holds no checkpoint; point it at the save directory of a "
            "bridge-train run",
        )


def _without_field(message: str, field: str) -> str:
    """Drop a leading ``checkpoint.<field>=...`` from a message that gets the field as location."""
    prefix = f"checkpoint.{field}="
    return message[len(prefix) :] if message.startswith(prefix) else message


def _check_cuda_features(cfg: ConfigContainer) -> None:
    if torch.cuda.is_available():
        return
    mode = cfg.rerun_state_machine.rerun_mode
    if mode != "disabled":
        raise ConfigError(
            "rerun_state_machine.rerun_mode",
            f"{mode!r} requires CUDA (megatron-core's rerun state machine saves and restores "
            "CUDA RNG state); use rerun_mode='disabled' on CPU",
        )
    profiling = cfg.profiling
    if profiling is not None and profiling.use_nsys_profiler:
        from bridge.train.loop.profiling import nsys_unavailable_reason

        raise ConfigError("profiling.use_nsys_profiler", str(nsys_unavailable_reason()))
    if cfg.nvrx_straggler is not None and cfg.nvrx_straggler.enabled:
        raise ConfigError(
            "nvrx_straggler.enabled",
            "nvidia-resiliency-ext straggler detection requires CUDA and CUPTI; use "
            "straggler.log_straggler=true on CPU",
        )


def _check_profiler_output(cfg: ConfigContainer) -> None:
    profiling = cfg.profiling
    if profiling is None or not profiling.use_pytorch_profiler:
        return
    from bridge.train.loop.profiling import profile_trace_dir

    if profile_trace_dir(cfg.logger, cfg.checkpoint) is None:
        raise ConfigError(
            "profiling.use_pytorch_profiler",
            "the trace needs a directory: set logger.tensorboard_dir (or checkpoint.save, "
            "which gets a 'profile' subdirectory)",
        )


def _check_data(cfg: ConfigContainer) -> None:
    if cfg.dataset is None:
        raise ConfigError(
            "dataset",
            "required section is missing; add a 'dataset:' mapping (blend: [[<prefix>], null] "
            "for data from bridge-preprocess-data, or _target_: "
            "bridge.config.MockGPTDatasetConfig for mock data)",
        )
    if not getattr(cfg.dataset, "data_sharding", True):
        raise ConfigError(
            "dataset.data_sharding",
            "false is not supported: every data-parallel rank reads only its own part of "
            "each global batch (the samplers shard by construction); set it to true",
        )
    from bridge.train.data.datasets import check_data_paths

    try:
        check_data_paths(cfg.dataset)
    except FileNotFoundError as exc:
        text = str(exc)
        location, _, detail = text.partition(": ")
        raise ConfigError(location or "dataset", detail or text) from None
    _check_data_files(cfg)
    from bridge.train.data.t5_datasets import check_t5_data_config

    check_t5_data_config(cfg.dataset, cfg.tokenizer)
    tokenizer = cfg.tokenizer
    if tokenizer is not None and tokenizer.tokenizer_type == "HuggingFaceTokenizer":
        model_path = tokenizer.tokenizer_model
        if model_path is not None and not Path(model_path).exists():
            raise ConfigError(
                "tokenizer.tokenizer_model",
                f"{model_path!r} does not exist; give a local directory with tokenizer.json "
                "(nothing is downloaded at run time)",
            )


def _check_data_files(cfg: ConfigContainer) -> None:
    """Damaged ``.bin``/``.idx`` files and token ids beyond the vocabulary, named with the fix."""
    from bridge.train.data.datasets import dataset_prefixes
    from bridge.train.data.file_checks import DataFileError, check_indexed_dataset

    vocab = getattr(cfg.tokenizer, "vocab_size", None) or getattr(cfg.model, "vocab_size", None)
    prefixes = dataset_prefixes(cfg.dataset)
    if vocab is None and prefixes and cfg.tokenizer is not None:
        from bridge.train.data.tokenizers import build_tokenizer

        try:  # the tokenizer knows its size (byte-level: 256 + specials)
            vocab = int(build_tokenizer(cfg.tokenizer).vocab_size)
        except Exception:  # a tokenizer that cannot be built is reported when it is built
            vocab = None
    for field, prefix in prefixes:
        try:
            check_indexed_dataset(prefix, vocab, field)
        except DataFileError as exc:
            raise ConfigError(field, str(exc)) from None


def _check_engine_and_layout(cfg: ConfigContainer, world_size: int) -> None:
    from bridge.train.checks.layout import check_engine_config
    from bridge.train.engine.base import build_engine
    from bridge.train.engine.initialize import resolve_distributed_backend, validate_parallel_layout

    assert cfg.train is not None
    # Wrong on every device (the p2p rule) or unsupported here: the most specific reason first.
    check_engine_config(
        cfg.model, cfg.train.engine, ddp_config=cfg.ddp, optimizer_config=cfg.optimizer
    )
    try:
        build_engine(cfg.train.engine)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError("train.engine", str(exc)) from None
    try:
        resolve_distributed_backend(cfg.dist)
    except ValueError as exc:
        raise ConfigError("dist.distributed_backend", str(exc)) from None
    try:
        validate_parallel_layout(cfg.model, world_size, cfg.train.engine)
    except ValueError as exc:
        raise ConfigError("model", str(exc)) from None


def check_config_before_launch(cfg: ConfigContainer, world_size: int | None = None) -> None:
    """Validate ``cfg`` for a training launch, before anything distributed is built.

    Runs ``cfg.validate(world_size)`` (filling derived values), then checks the data files,
    the tokenizer files, the checkpoint directories, the engine, backend and parallel layout
    against this machine, and features that need CUDA.

    Args:
        cfg: The run's configuration.
        world_size: Number of ranks (default: the initialised process group's, else
            ``$WORLD_SIZE``, else 1).

    Raises:
        ConfigError: Anything to fix in the config; the message names the field.
    """
    world = world_size if world_size is not None else global_world_size(launcher_fallback=True)
    cfg.validate(world)
    from bridge.train.checks.inputs import check_run_inputs

    check_run_inputs(cfg)
    _check_engine_and_layout(cfg, world)
    _check_cuda_features(cfg)
    _check_data(cfg)
    check_finetuning_config(cfg)
    assert cfg.checkpoint is not None
    check_checkpoint_directories(cfg.checkpoint)
    _check_profiler_output(cfg)
