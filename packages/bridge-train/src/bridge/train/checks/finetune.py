"""Launch checks of the finetuning sections: ``dataset`` (finetuning), ``peft``.

Everything a finetuning config asks for is either honoured or refused here, before any
process group exists, with a :class:`bridge.config.ConfigError` naming the field (the
``bridge-train`` command exits with code 2).
"""

from __future__ import annotations

from typing import Any

from bridge.config import ConfigContainer, ConfigError, FinetuningDatasetConfig

__all__ = ["check_finetuning_config"]


def check_finetuning_config(cfg: ConfigContainer) -> None:
    """Refuse finetuning settings the trainer cannot honour.

    Checks a ``FinetuningDatasetConfig`` (files, ``dataset_kwargs``, loader settings,
    packed-sequence settings against the model) and the ``peft`` section.

    Args:
        cfg: The validated config.

    Raises:
        ConfigError: The message names the field and the fix.
    """
    dataset = cfg.dataset
    if isinstance(dataset, FinetuningDatasetConfig):
        from bridge.train.data.packing import check_packed_sequence_specs
        from bridge.train.data.sft import check_finetuning_dataset

        check_finetuning_dataset(dataset)
        specs = dataset.packed_sequence_specs
        check_packed_sequence_specs(specs, dataset.seq_length, cfg.model)
        if specs is not None and specs.packed_sequence_size > 0:
            _check_packed_micro_batch(cfg)
    if cfg.peft is not None:
        _check_peft(cfg.peft, cfg)


def _check_packed_micro_batch(cfg: ConfigContainer) -> None:
    # Transformer Engine's thd layout is one sequence of packed examples per micro-batch.
    resolve = getattr(cfg.model, "resolved_layer_spec_backend", None)
    if resolve is None or resolve() != "transformer_engine":
        return
    micro_batch_size = getattr(cfg.train, "micro_batch_size", 1)
    if micro_batch_size != 1:
        raise ConfigError(
            "train.micro_batch_size",
            f"got {micro_batch_size}; packed sequences with Transformer Engine take "
            "one packed sequence per micro-batch (PackedSeqParams, thd layout): set it to 1 "
            "(a packed sequence already holds several examples)",
        )


def _check_peft(peft: Any, cfg: ConfigContainer) -> None:
    if not callable(peft):
        raise ConfigError(
            "peft",
            f"{type(peft).__qualname__} is not a PEFT transform: it must be callable as "
            "peft(model, training=True) -> model (e.g. _target_: bridge.train.peft.LoRA)",
        )
    model = cfg.model
    if getattr(model, "sequence_parallel", False):
        raise ConfigError(
            "model.sequence_parallel",
            "adapters are applied without sequence parallelism; set it to false with peft",
        )
