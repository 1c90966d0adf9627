"""Every train/validation/test split of a ``.bin``/``.idx`` dataset must hold a sample.

megatron-core's ``GPTDataset`` gives each split a contiguous range of a prefix's documents
(``dataset.split`` weights, rounded to whole documents) and then repeats that range until
the split has as many tokens as its samples need (``_get_num_epochs``). A range with no
document holds no token, and that loop never ends: ``--recipe text_corpus`` on a corpus
preprocessed as one document (a plain text file without ``--split-lines``) spun at 100% CPU
with no output, after ``--dry-run`` had called the config valid. A range holding fewer
tokens than one sample would be repeated thousands of times over.

:func:`check_split_samples` reads each prefix's index (a few bytes per document, NumPy
only) and refuses such a split, naming it, its documents and tokens, and the fix. The
split ranges are megatron-core's own (``parse_and_normalize_split`` and
``convert_split_vector_to_split_matrix``, the same rounding its builder applies).
"""

from __future__ import annotations

import functools

from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)

from bridge.config import ConfigError, FinetuningDatasetConfig, GPTDatasetConfig
from bridge.train.data.datasets import _SPLIT_NAMES, dataset_prefixes
from bridge.train.data.file_checks import read_sequence_lengths

__all__ = ["check_split_samples"]


def _ranges(
    dataset_config: GPTDatasetConfig | FinetuningDatasetConfig,
) -> list[tuple[str, str, int, tuple[float, float]]]:
    """``(field, prefix, split index, (begin, end) fraction)`` for every range megatron builds."""
    found: list[tuple[str, str, int, tuple[float, float]]] = []
    if getattr(dataset_config, "blend_per_split", None) is not None:
        # Each split's prefixes are used whole.
        for field, prefix in dataset_prefixes(dataset_config):
            name = field.partition("[")[2].rstrip("]")
            if name in _SPLIT_NAMES:
                found.append((field, prefix, _SPLIT_NAMES.index(name), (0.0, 1.0)))
        return found
    split = getattr(dataset_config, "split", None)
    if not split:
        return found
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(str(split)))
    for _, prefix in dataset_prefixes(dataset_config):
        for index, bounds in enumerate(matrix):
            if bounds is not None:
                found.append(("dataset.split", prefix, index, bounds))
    return found


def check_split_samples(
    dataset_config: GPTDatasetConfig | FinetuningDatasetConfig,
    num_samples: tuple[int, int, int],
    *,
    gpt_samples: bool = True,
) -> None:
    """Refuse a split megatron-core would hang on or fill with one repeated document.

    Args:
        dataset_config: The ``dataset`` section; only real (not mock) data with a ``blend``
            or ``blend_per_split`` and a ``sequence_length`` is checked.
        num_samples: ``(train, valid, test)`` samples the run draws
            (:func:`bridge.train.data.datasets.train_valid_test_num_samples`).
        gpt_samples: Samples are GPT's (``sequence_length`` tokens plus the extra one), so a
            split with fewer tokens is refused too; False for other sample shapes (T5's
            span corruption), where only a split without a document is refused.

    Raises:
        ConfigError: A split gets no document (megatron-core would loop forever), or a split
            the run draws from holds fewer tokens than one sample. The message names the
            field, the prefix, the split, its documents and tokens, and what to change.
    """
    sequence_length = getattr(dataset_config, "sequence_length", None)
    if not isinstance(sequence_length, int):
        return
    sample = sequence_length + int(bool(getattr(dataset_config, "add_extra_token_to_sequence", 1)))
    lengths = functools.cache(read_sequence_lengths)  # each prefix's index read once
    for field, prefix, index, (begin, end) in _ranges(dataset_config):
        sizes = lengths(prefix)
        total = len(sizes)
        first, last = round(begin * total), round(end * total)  # megatron's rounding
        documents = max(last - first, 0)
        tokens = int(sizes[first:last].sum()) if documents else 0
        split_name = _SPLIT_NAMES[index]
        if tokens == 0:
            where = (
                f"{prefix!r} holds no document"
                if total == 0
                else f"the {split_name} split of {prefix!r} gets no document ({total} "
                f"document{'s' if total != 1 else ''} in all, split "
                f"{getattr(dataset_config, 'split', None)!r})"
            )
            raise ConfigError(
                field,
                f"{where}; megatron-core would loop forever building it. {_FIX}",
            )
        if gpt_samples and tokens < sample and num_samples[index] > 0:
            raise ConfigError(
                field,
                f"the {split_name} split of {prefix!r} holds {documents} "
                f"document{'s' if documents != 1 else ''} of {tokens} tokens in all, fewer than "
                f"one sample ({sample} tokens: sequence length {sequence_length}"
                f"{' + 1' if sample > sequence_length else ''}); "
                f"it would repeat the same tokens in every sample. {_FIX}",
            )


_FIX = (
    "Give every split more documents (bridge-preprocess-data --split-lines makes each line "
    "of a text file a document), or train on all of it: dataset.split=100,0,0 "
    "train.eval_iters=0"
)
