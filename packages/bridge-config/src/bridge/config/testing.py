"""Small model and optimizer configs for tests that run without megatron-core.

bridge-config, bridge-logging and bridge-resiliency are tested in environments without
megatron-core, yet a ``ConfigContainer`` needs ``model`` and ``optimizer`` sections. These
dataclasses provide ``ModelConfigProtocol`` and ``OptimizerConfigProtocol`` with
megatron-core's field names and defaults, are importable by name (so they round-trip
through YAML via ``_target_``), and ``tiny_container()`` assembles a container that
validates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from bridge.config._checkpoint import CheckpointConfig
from bridge.config._container import ConfigContainer
from bridge.config._data import MockGPTDatasetConfig
from bridge.config._logger import LoggerConfig
from bridge.config._tokenizer import TokenizerConfig
from bridge.config._training import SchedulerConfig, TrainingConfig

__all__ = [
    "ExampleCommOverlapConfig",
    "ExampleModelConfig",
    "ExampleOptimizerConfig",
    "tiny_container",
]


@dataclass(kw_only=True)
class ExampleModelConfig:
    """A GPT model description with megatron-core ``TransformerConfig`` field names."""

    num_layers: int = 2
    """Transformer layers."""

    hidden_size: int = 64
    """Hidden size."""

    num_attention_heads: int = 4
    """Attention heads."""

    seq_length: int = 32
    """Tokens per sample."""

    vocab_size: int | None = 128
    """Vocabulary size of the embedding."""

    tensor_model_parallel_size: int = 1
    """Tensor-parallel size."""

    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size."""

    virtual_pipeline_model_parallel_size: int | None = None
    """Virtual pipeline stages per rank."""

    context_parallel_size: int = 1
    """Context-parallel size."""

    expert_model_parallel_size: int = 1
    """Expert-parallel size."""

    params_dtype: torch.dtype = torch.float32
    """Parameter dtype (a ``torch.dtype``)."""

    bf16: bool = False
    """Run in bf16."""

    fp16: bool = False
    """Run in fp16."""


@dataclass(kw_only=True)
class ExampleOptimizerConfig:
    """An optimizer description with megatron-core ``OptimizerConfig`` field names."""

    optimizer: str = "adam"
    """Optimizer name."""

    lr: float | None = 1e-3
    """Peak learning rate."""

    min_lr: float | None = 0.0
    """Final learning rate."""

    weight_decay: float = 0.01
    """Weight decay."""

    adam_beta1: float = 0.9
    """Adam beta1."""

    adam_beta2: float = 0.999
    """Adam beta2."""

    adam_eps: float = 1e-8
    """Adam epsilon."""

    clip_grad: float = 1.0
    """Gradient clipping norm."""

    use_distributed_optimizer: bool = False
    """Shard optimizer state across data-parallel ranks."""

    bf16: bool = False
    """Run in bf16."""

    fp16: bool = False
    """Run in fp16."""


@dataclass(kw_only=True)
class ExampleCommOverlapConfig:
    """Communication-overlap settings with the fields ``validate()`` reads.

    ``setup`` records the sections it was given instead of changing them (the trainer's
    ``bridge.train.engine.comm_overlap.CommOverlapConfig`` writes the overlap fields).
    """

    tp_comm_overlap: bool = False
    """Tensor-parallel communication overlap."""

    data_parallel_size: int | None = None
    """Filled in by ``validate()``."""

    def __post_init__(self) -> None:
        self.setup_calls: list[tuple[Any, Any, Any]] = []

    def setup(self, model: Any, optimizer: Any, ddp: Any) -> None:
        """Record the call."""
        self.setup_calls.append((model, optimizer, ddp))


def tiny_container(**sections: Any) -> ConfigContainer:
    """A complete, small ``ConfigContainer`` (mock data, 10 iterations) that validates.

    Args:
        **sections: Sections to use instead of the defaults (e.g. ``train=TrainingConfig(...)``).

    Returns:
        The container, not yet validated.
    """
    defaults: dict[str, Any] = {
        "train": TrainingConfig(micro_batch_size=2, train_iters=10, eval_interval=5, eval_iters=2),
        "model": ExampleModelConfig(),
        "optimizer": ExampleOptimizerConfig(),
        "scheduler": SchedulerConfig(lr_warmup_iters=2),
        "dataset": MockGPTDatasetConfig(
            random_seed=1234,
            sequence_length=32,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            num_workers=0,
        ),
        "logger": LoggerConfig(log_interval=1),
        "tokenizer": TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=128),
        "checkpoint": CheckpointConfig(),
    }
    defaults.update(sections)
    return ConfigContainer(**defaults)
