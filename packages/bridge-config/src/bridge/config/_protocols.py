"""What the config layer needs of the sections that megatron-core (or a trainer) provides.

bridge.config never imports megatron-core. The ``model``, ``optimizer``, ``ddp``, ``peft``,
``comm_overlap`` and ``mixed_precision`` sections accept any object with these attributes:
megatron-core's ``TransformerConfig`` subclasses (model providers), ``OptimizerConfig``,
``DistributedDataParallelConfig``, or small dataclasses of one's own. The ``tokenizer``
section accepts bridge.config's ``TokenizerConfig`` or any object with the attributes of
``TokenizerConfigProtocol`` (such as Megatron-Bridge's own ``TokenizerConfig``).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class ModelConfigProtocol(Protocol):
    """A model configuration: megatron-core ``TransformerConfig`` fields plus ``seq_length``.

    A plain ``TransformerConfig`` has no ``seq_length``; model providers (subclasses that
    also build the model) add it, and usually ``vocab_size``, which ``validate()`` checks
    against the tokenizer when present. ``validate()`` also reads, when present,
    ``expert_tensor_parallel_size`` (unset: the tensor-parallel size) and
    ``num_moe_experts`` to check the expert-parallel layout.
    """

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: int | None
    context_parallel_size: int
    expert_model_parallel_size: int
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    params_dtype: Any
    bf16: bool
    fp16: bool


@runtime_checkable
class OptimizerConfigProtocol(Protocol):
    """An optimizer configuration such as megatron-core's ``OptimizerConfig``."""

    optimizer: str
    lr: float | None
    min_lr: float | None
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    clip_grad: float
    use_distributed_optimizer: bool
    bf16: bool
    fp16: bool


@runtime_checkable
class DDPConfigProtocol(Protocol):
    """A data-parallel configuration such as megatron-core's ``DistributedDataParallelConfig``."""

    grad_reduce_in_fp32: bool
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    use_distributed_optimizer: bool
    check_for_nan_in_grad: bool
    average_in_collective: bool
    bucket_size: int | None


@runtime_checkable
class PEFTProtocol(Protocol):
    """A parameter-efficient finetuning transform: called on the model, returns the model."""

    def __call__(self, model: Any, training: bool = True) -> Any:
        """Apply the transform (e.g. insert LoRA adapters and freeze the base weights)."""
        ...


@runtime_checkable
class CommOverlapConfigProtocol(Protocol):
    """Communication-overlap settings (``bridge.train.engine.comm_overlap.CommOverlapConfig``).

    ``validate()`` fills in ``data_parallel_size``, then calls ``setup`` to write the overlap
    settings into the model, optimizer and ddp sections.
    """

    tp_comm_overlap: bool
    data_parallel_size: int | None

    def setup(self, model: Any, optimizer: Any, ddp: Any) -> None:
        """Write the overlap settings into the sections (raise ``ConfigError`` on a conflict)."""
        ...


@runtime_checkable
class MixedPrecisionConfigProtocol(Protocol):
    """A mixed-precision recipe, checked against the model's dtype flags by ``validate()``."""

    bf16: bool
    fp16: bool
    params_dtype: Any


@runtime_checkable
class TokenizerConfigProtocol(Protocol):
    """A tokenizer configuration: what ``validate()`` and the trainer read of it.

    ``validate()`` checks the vocabulary (``vocab_size`` plus ``vocab_extra_ids``, or for
    ``"ByteLevelTokenizer"`` the 256 byte ids plus special tokens, read from an optional
    ``special_tokens`` list) against ``model.vocab_size``; the trainer builds the tokenizer
    from ``tokenizer_type`` and ``tokenizer_model``.
    """

    tokenizer_type: str | None
    tokenizer_model: str | None
    vocab_size: int | None
    vocab_extra_ids: int
