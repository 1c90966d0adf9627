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
)

__all__ = ["ARCHITECTURE_FIELDS", "check_same_architecture"]

logger = logging.getLogger(__name__)

#: Model fields that define the computation a checkpoint's weights belong to (the model's
#: :data:`bridge.train.models.architecture.ARCHITECTURE_FIELDS` and the vocabulary
#: padding). Fields a model class does not have are skipped; ``seq_length`` is not here (a
#: longer context on rotary embeddings is a legitimate resume; learned positions differ in
#: shape anyway).
ARCHITECTURE_FIELDS: tuple[str, ...] = (*MODEL_ARCHITECTURE_FIELDS, "make_vocab_size_divisible_by")


def _show(value: Any) -> str:
    name = getattr(value, "__qualname__", None)
    return name if callable(value) and name else repr(value)


def check_same_architecture(
    model_config: ModelConfigProtocol | None,
    checkpoint_dir: str | os.PathLike[str],
    *,
    before_setup: bool = False,
) -> None:
    """Refuse to resume ``checkpoint_dir`` into a model of another architecture.

    Args:
        model_config: This run's model config (``cfg.model``); None compares nothing.
        checkpoint_dir: The checkpoint about to be loaded.
        before_setup: Called before the run is set up (a launch check): fields this run
            leaves unset are filled in later (``vocab_size`` from the tokenizer) and are
            not compared.

    Raises:
        CheckpointError: Listing every differing field with both values, and the way to
            load the weights into a different model on purpose.
    """
    path = Path(checkpoint_dir) / RUN_CONFIG_FILENAME
    if model_config is None or not path.is_file():
        return

    try:
        saved = ConfigContainer.from_yaml(path).model
    except ConfigError as exc:
        logger.info("not comparing the architecture with %s: %s", path, exc)
        return
    differing = []
    if type(saved) is not type(model_config):
        differing.append(
            f"model class (checkpoint {type(saved).__name__}, this run "
            f"{type(model_config).__name__})"
        )
    else:
        for name in ARCHITECTURE_FIELDS:
            if not (hasattr(saved, name) and hasattr(model_config, name)):
                continue
            before, now = getattr(saved, name), getattr(model_config, name)
            if before_setup and now is None:
                continue
            if not same_setting(before, now):
                differing.append(f"{name} (checkpoint {_show(before)}, this run {_show(now)})")
    if differing:
        raise CheckpointError(
            f"the model differs from the one saved in {path}: {'; '.join(differing)}. "
            "Resume with the saved model settings, or set checkpoint.finetune=True (or load "
            "it through checkpoint.pretrained_checkpoint) to start a new run from its weights"
        )
