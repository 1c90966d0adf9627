"""Per-model-family choices of ``pretrain``: the default forward step and the datasets.

GPT and hybrid Mamba models are causal language models: GPT datasets and
:func:`bridge.train.forward_step`. T5 models (:class:`bridge.train.T5ModelProvider`) take
T5 span-corruption data (:class:`bridge.train.data.t5_datasets.T5DatasetConfig`) and
:func:`bridge.train.models.t5_step.t5_forward_step`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeGuard

from bridge.config import ConfigError
from bridge.train.data.datasets import build_train_valid_test_datasets
from bridge.train.data.t5_datasets import T5DatasetConfig, build_t5_datasets
from bridge.train.data.t5_tokenizer import T5Tokenizer
from bridge.train.data.tokenizers import Tokenizer
from bridge.train.models.gpt_step import forward_step
from bridge.train.models.t5_provider import T5ModelProvider
from bridge.train.models.t5_step import t5_forward_step
from bridge.train.state import ForwardStepCallable

if TYPE_CHECKING:
    from bridge.config import (
        FinetuningDatasetConfig,
        GPTDatasetConfig,
        ModelConfigProtocol,
        TokenizerConfig,
        TokenizerConfigProtocol,
    )

__all__ = ["build_family_datasets", "default_forward_step", "family_tokenizer", "is_t5"]


def is_t5(model_config: ModelConfigProtocol | None) -> TypeGuard[T5ModelProvider]:
    """Whether ``model_config`` describes a T5 (encoder-decoder) model."""
    return isinstance(model_config, T5ModelProvider)


def default_forward_step(model_config: ModelConfigProtocol | None) -> ForwardStepCallable:
    """The forward step ``pretrain`` uses for ``model_config`` when none is given."""
    return t5_forward_step if is_t5(model_config) else forward_step


def family_tokenizer(
    dataset_config: GPTDatasetConfig | FinetuningDatasetConfig | None,
    tokenizer_config: TokenizerConfig | TokenizerConfigProtocol | None,
    tokenizer: Tokenizer,
) -> Any:
    """The tokenizer the model family's data reads: for indexed T5 data, ``tokenizer`` with
    the T5 sentinel and special tokens (:class:`bridge.train.data.t5_tokenizer.T5Tokenizer`,
    ``tokenizer.vocab_extra_ids`` sentinels); otherwise ``tokenizer`` itself."""

    if isinstance(dataset_config, T5DatasetConfig) and dataset_config.is_indexed:
        return T5Tokenizer(tokenizer, int(getattr(tokenizer_config, "vocab_extra_ids", 0) or 0))
    return tokenizer


def build_family_datasets(
    model_config: ModelConfigProtocol | None,
    dataset_config: GPTDatasetConfig | FinetuningDatasetConfig | None,
    tokenizer: Tokenizer,
    num_samples: tuple[int, int, int],
) -> tuple[Any, Any, Any]:
    """Train, validation and test datasets for the model family.

    Raises:
        bridge.config.ConfigError: A T5 model with non-T5 data or the other way round.
    """

    if is_t5(model_config):
        if not isinstance(dataset_config, T5DatasetConfig):
            raise ConfigError(
                "dataset",
                "a T5 model needs T5 span-corruption data: _target_: "
                "bridge.train.data.t5_datasets.T5DatasetConfig",
            )
        if dataset_config.sequence_length_dec != model_config.seq_length_dec:
            raise ConfigError(
                "dataset.sequence_length_dec",
                f"got {dataset_config.sequence_length_dec} but model.seq_length_dec is "
                f"{model_config.seq_length_dec}; they must be equal",
            )
        return build_t5_datasets(dataset_config, tokenizer, num_samples)
    if isinstance(dataset_config, T5DatasetConfig):
        raise ConfigError("dataset", "T5 span-corruption data needs a T5ModelProvider model")
    if dataset_config is None:
        raise ConfigError("dataset", "is not set; the run needs a dataset section to train on")
    return build_train_valid_test_datasets(dataset_config, tokenizer, num_samples)
