"""The resume check: the model being resumed must be the model that was saved.

dist_checkpointing compares tensor shapes only, and several architecture changes keep every
shape: more attention heads of a smaller size (``num_attention_heads`` with ``kv_channels``
fixed by ``hidden_size``), another vocabulary padded to the same table size, a changed
activation or normalisation, rotary settings. Loading such a checkpoint "works" and
trains a different model on the old weights. A resume is therefore compared with the
checkpoint's ``run_config.yaml`` (covered by the checkpoint's checksums) field by field;
a finetune-style load (``checkpoint.finetune``, ``checkpoint.pretrained_checkpoint``),
which deliberately starts a new run from the weights, is not checked.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from bridge.config import ConfigContainer, ConfigError, ModelConfigProtocol
from bridge.train.checkpointing.errors import CheckpointError
from bridge.train.checkpointing.layout import RUN_CONFIG_FILENAME
from bridge.train.models.architecture import (
    ARCHITECTURE_FIELDS as MODEL_ARCHITECTURE_FIELDS,
    same_setting,
    show_setting,
)

__all__ = [
    "ARCHITECTURE_FIELDS",
    "check_same_architecture",
    "differences",
    "read_run_config",
    "saved_run_config",
]

logger = logging.getLogger(__name__)

#: Model fields that define the computation a checkpoint's weights belong to (the model's
#: :data:`bridge.train.models.architecture.ARCHITECTURE_FIELDS` and the vocabulary
#: padding). Fields a model class does not have are skipped; ``seq_length`` is not here (a
#: longer context on rotary embeddings is a legitimate resume; learned positions differ in
#: shape anyway).
ARCHITECTURE_FIELDS: tuple[str, ...] = (*MODEL_ARCHITECTURE_FIELDS, "make_vocab_size_divisible_by")


def saved_run_config(checkpoint_dir: str | os.PathLike[str]) -> ConfigContainer | None:
    """The run config ``checkpoint_dir`` was saved with (its ``run_config.yaml``), or None
    when it has none.

    Raises:
        ConfigError: It no longer loads (saved by an older version, or naming a class no
            longer importable).
        OSError: It cannot be read.
    """
    path = Path(checkpoint_dir) / RUN_CONFIG_FILENAME
    return ConfigContainer.from_yaml(path) if path.is_file() else None


def read_run_config(checkpoint_dir: str | os.PathLike[str]) -> ConfigContainer | None:
    """:func:`saved_run_config` for the resume checks: also None (logged) when it no longer
    loads."""
    path = Path(checkpoint_dir) / RUN_CONFIG_FILENAME
    try:
        return saved_run_config(checkpoint_dir)
    except ConfigError as exc:
        logger.info("not comparing this run with %s: %s", path, exc)
        return None


def differences(saved: dict[str, Any], current: dict[str, Any], label: str) -> list[str]:
    """``key (<label> X, this run Y)`` for each key whose values differ (by
    :func:`~bridge.train.models.architecture.same_setting`; a missing key is None): the one
    comparison of saved and current settings, here and in :mod:`bridge.train.checks.resume`.
    """
    return [
        f"{key} ({label} {show_setting(saved.get(key))}, this run {show_setting(current.get(key))})"
        for key in dict.fromkeys([*saved, *current])
        if not same_setting(saved.get(key), current.get(key))
    ]


def check_same_architecture(
    model_config: ModelConfigProtocol | None,
    checkpoint_dir: str | os.PathLike[str],
    *,
    before_setup: bool = False,
    saved_model: ModelConfigProtocol | None = None,
) -> None:
    """Refuse to resume ``checkpoint_dir`` into a model of another architecture.

    Args:
        model_config: This run's model config (``cfg.model``); None compares nothing.
        checkpoint_dir: The checkpoint about to be loaded.
        before_setup: Called before the run is set up (a launch check): fields this run
            leaves unset are filled in later (``vocab_size`` from the tokenizer) and are
            not compared.
        saved_model: The saved run config's model when the caller has read it
            (:func:`read_run_config`); else it is read here.

    Raises:
        CheckpointError: Listing every differing field with both values, and the way to
            load the weights into a different model on purpose.
    """
    if model_config is None:
        return
    if saved_model is None:
        saved = read_run_config(checkpoint_dir)
        if saved is None:
            return
        saved_model = saved.model
    if type(saved_model) is not type(model_config):
        differing = [
            f"model class (checkpoint {type(saved_model).__name__}, this run "
            f"{type(model_config).__name__})"
        ]
    else:
        now = {n: getattr(model_config, n) for n in ARCHITECTURE_FIELDS if hasattr(model_config, n)}
        if before_setup:  # what this run leaves unset is filled in at setup
            now = {name: value for name, value in now.items() if value is not None}
        differing = differences(
            {name: getattr(saved_model, name) for name in now}, now, "checkpoint"
        )
    if differing:
        raise CheckpointError(
            "the model differs from the one saved in "
            f"{Path(checkpoint_dir) / RUN_CONFIG_FILENAME}: {'; '.join(differing)}. "
            "Resume with the saved model settings, or set checkpoint.finetune=True (or load "
            "it through checkpoint.pretrained_checkpoint) to start a new run from its weights"
        )
