"""Data: tokenizers, preprocessing into indexed datasets, datasets, samplers, iterators."""

from bridge.train.data.datasets import (
    build_gpt_dataset_config,
    build_train_valid_test_datasets,
    check_data_paths,
    train_valid_test_num_samples,
)
from bridge.train.data.loaders import (
    build_data_loader,
    build_train_valid_test_data_iterators,
    build_train_valid_test_data_loaders,
    cyclic_iter,
)
from bridge.train.data.preprocess import PreprocessResult, preprocess_data
from bridge.train.data.samplers import CyclicRandomSampler, PretrainingSampler
from bridge.train.data.tokenizers import (
    ByteLevelTokenizer,
    HuggingFaceTokenizer,
    NullTokenizer,
    Tokenizer,
    build_tokenizer,
)

__all__ = [
    "ByteLevelTokenizer",
    "CyclicRandomSampler",
    "HuggingFaceTokenizer",
    "NullTokenizer",
    "PreprocessResult",
    "PretrainingSampler",
    "Tokenizer",
    "build_data_loader",
    "build_gpt_dataset_config",
    "build_tokenizer",
    "build_train_valid_test_data_iterators",
    "build_train_valid_test_data_loaders",
    "build_train_valid_test_datasets",
    "check_data_paths",
    "cyclic_iter",
    "preprocess_data",
    "train_valid_test_num_samples",
]
