"""Inputs a run would accept silently, or hang on, refused before anything starts.

Each check turns a value that would otherwise cost a user hours into one
:class:`bridge.config.ConfigError` naming the field and the fix:

* ``checkpoint.load`` naming a directory that does not exist (the run would train from
  scratch without a word);
* evaluation switched on (``train.eval_iters`` > 0) while the data has no validation part
  (``dataset.split`` with a validation weight of 0, or no validation blend);
* a training length whose dataset index cannot be built on this machine
  (``train.train_iters=10**23`` spins for hours in megatron-core's index building);
* a ``tokenizer.tokenizer_type`` the config accepts but this installation cannot build
  (its optional package is missing, or a vocabulary file it reads is missing), which would
  otherwise fail after the process groups are up, and ``tokenizer.hf_tokenizer_kwargs``
  (no ``AutoTokenizer`` is involved, so it would be ignored).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from bridge.config import ConfigError

__all__ = ["INDEX_BYTES_PER_SAMPLE", "check_run_inputs"]

#: Bytes megatron-core's GPT dataset index takes per sample: the shuffle index (int64) and
#: the sample index (two int64 per sample), rounded up.
INDEX_BYTES_PER_SAMPLE = 24


def _check_load_directory(checkpoint: Any) -> None:
    load = getattr(checkpoint, "load", None)
    if load is None or Path(load).exists():
        return
    save = getattr(checkpoint, "save", None)
    if save is not None and Path(save).resolve() == Path(load).resolve():
        return  # load == save: the first run of a resumable job has nothing to load yet
    raise ConfigError(
        "checkpoint.load",
        f"{str(load)!r} does not exist, so nothing would be loaded and the run would start "
        "from scratch; fix the path, or drop checkpoint.load (with checkpoint.save set a "
        "run resumes from its own save directory)",
    )


def _validation_weight(dataset: Any) -> float | None:
    """Weight of the validation part of the data, or None when it cannot be told."""
    per_split = getattr(dataset, "blend_per_split", None)
    if per_split is not None:
        return 0.0 if len(per_split) < 2 or per_split[1] is None else 1.0
    split = getattr(dataset, "split", None)
    if split is None:
        return None
    from bridge.config import parse_split

    try:
        return parse_split(split)[1]
    except ValueError:
        return None


def _check_evaluation_data(cfg: Any) -> None:
    train, dataset = cfg.train, cfg.dataset
    if train is None or dataset is None or not getattr(train, "eval_iters", 0):
        return
    if getattr(train, "skip_train", False):
        return
    weight = _validation_weight(dataset)
    if weight is None or weight > 0:
        return
    where = (
        "dataset.blend_per_split has no validation blend"
        if getattr(dataset, "blend_per_split", None) is not None
        else f"dataset.split={dataset.split!r} gives the validation part weight 0"
    )
    raise ConfigError(
        "train.eval_iters",
        f"is {train.eval_iters}, so the run evaluates, but {where}; give the validation "
        "part data (e.g. dataset.split='98,2,0') or set train.eval_iters=0 to train "
        "without evaluation",
    )


def _physical_memory() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _check_dataset_size(cfg: Any) -> None:
    from bridge.train.data.datasets import train_valid_test_num_samples

    train = cfg.train
    if train is None or train.global_batch_size is None or getattr(train, "skip_train", False):
        return
    if train.train_iters is None and train.train_samples is None:
        return
    samples = sum(train_valid_test_num_samples(train))
    memory = _physical_memory()
    needed = samples * INDEX_BYTES_PER_SAMPLE
    if memory is None or needed <= memory:
        return
    field = "train.train_samples" if train.train_samples is not None else "train.train_iters"
    value = train.train_samples if train.train_samples is not None else train.train_iters
    raise ConfigError(
        field,
        f"got {value}: that is {samples:.3g} samples, whose dataset index alone needs about "
        f"{needed / 2**30:.3g} GiB ({INDEX_BYTES_PER_SAMPLE} bytes per sample), more than "
        f"this machine's {memory / 2**30:.3g} GiB of memory; train for fewer iterations",
    )


# The files each file-based tokenizer type reads (all must exist before the run starts).
_TOKENIZER_FILES: dict[str, tuple[str, ...]] = {
    "SentencePieceTokenizer": ("tokenizer_model",),
    "TikTokenizer": ("tokenizer_model",),
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
}


def _check_tokenizer(cfg: Any) -> None:
    from bridge.train.data.tokenizer_packages import missing_tokenizer_package

    if cfg.tokenizer is None:
        return
    if getattr(cfg.tokenizer, "hf_tokenizer_kwargs", None):
        raise ConfigError(
            "tokenizer.hf_tokenizer_kwargs",
            "is not used: bridge-train reads tokenizer.json with Hugging Face tokenizers, not "
            "AutoTokenizer.from_pretrained; remove it (add tokens with tokenizer.special_tokens)",
        )
    kind = getattr(cfg.tokenizer, "tokenizer_type", None)
    if kind is None:
        return
    message = missing_tokenizer_package(kind)
    if message is not None:
        raise ConfigError("tokenizer.tokenizer_type", message)
    for name in _TOKENIZER_FILES.get(kind, ()):
        path = getattr(cfg.tokenizer, name, None)
        if path is not None and not Path(path).is_file():
            raise ConfigError(
                f"tokenizer.{name}",
                f"{str(path)!r} does not exist or is not a file; point it to the {kind} file",
            )


def check_run_inputs(cfg: Any) -> None:
    """Run the checks of this module on a validated config (see the module docstring).

    Args:
        cfg: The run's ``ConfigContainer``, after ``validate()``.

    Raises:
        ConfigError: naming the field and the fix.
    """
    if cfg.checkpoint is not None:
        _check_load_directory(cfg.checkpoint)
    _check_evaluation_data(cfg)
    _check_dataset_size(cfg)
    _check_tokenizer(cfg)
