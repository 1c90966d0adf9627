"""The default data-parallel section, usable without megatron-core."""

from __future__ import annotations

from dataclasses import dataclass

from bridge.config._checks import at_least, at_most_one
from bridge.config._codec import normalize_fields
from bridge.config._errors import field_error
from bridge.config._section import config_section


@config_section
@dataclass(kw_only=True)
class DistributedDataParallelConfig:
    """Data-parallel settings with megatron-core's field names and defaults (a subset).

    ``ConfigContainer.ddp`` defaults to this class, so a container can be built, saved and
    validated without megatron-core installed, and the YAML it writes loads anywhere. Every
    field has the name and default of megatron-core's ``DistributedDataParallelConfig``, so
    the trainer builds megatron's class from it with ``convert_dataclass``. For megatron
    options not listed here, set ``ddp._target_:
    megatron.core.distributed.DistributedDataParallelConfig`` and use megatron's class
    directly.
    """

    grad_reduce_in_fp32: bool = False
    """Accumulate and all-reduce gradients in fp32 even when the model runs in bf16/fp16."""

    overlap_grad_reduce: bool = False
    """Overlap the gradient reduction with the backward pass (bucket by bucket)."""

    overlap_param_gather: bool = False
    """Overlap the distributed optimizer's parameter all-gather with the forward pass
    (needs ``use_distributed_optimizer``)."""

    align_param_gather: bool = False
    """With pipeline parallelism, launch all parameter all-gathers of the first virtual stage
    together instead of as each bucket is needed."""

    use_distributed_optimizer: bool = False
    """Shard optimizer state across data-parallel ranks. Must match the optimizer section's
    ``use_distributed_optimizer``."""

    num_distributed_optimizer_instances: int = 1
    """Number of distributed-optimizer replicas (each shards over a subset of the
    data-parallel ranks)."""

    check_for_nan_in_grad: bool = False
    """Check the reduced gradients for NaN and fail when one is found."""

    check_for_large_grads: bool = False
    """Check the reduced gradients for unexpectedly large values and fail when one is found."""

    bucket_size: int | None = None
    """Elements per gradient-reduction bucket (unset: megatron chooses)."""

    num_buckets: int | None = None
    """Number of gradient-reduction buckets, as an alternative to ``bucket_size`` (exclusive
    with it)."""

    pad_buckets_for_high_nccl_busbw: bool = False
    """Pad buckets to a size divisible by a large power of 2 for better NCCL bus bandwidth."""

    average_in_collective: bool = False
    """Average gradients inside the collective instead of scaling before or after it."""

    use_megatron_fsdp: bool = False
    """Shard parameters with megatron-core's fully sharded data parallelism."""

    data_parallel_sharding_strategy: str = "no_shard"
    """What megatron-core FSDP shards: ``"no_shard"``, ``"optim"``, ``"optim_grads"`` or
    ``"optim_grads_params"``."""

    gradient_reduce_div_fusion: bool = True
    """Fuse the division by the data-parallel size into the gradient reduction."""

    def __post_init__(self) -> None:
        """Check the field types, bucket settings and the parameter-gather requirement."""
        normalize_fields(self)
        at_least(self, "bucket_size", 1)
        at_least(self, "num_buckets", 1)
        at_most_one(self, "bucket_size", "num_buckets")
        at_least(self, "num_distributed_optimizer_instances", 1, allow_none=False)
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise field_error(
                self, "overlap_param_gather", True, "it needs use_distributed_optimizer=True"
            )
        strategies = ("no_shard", "optim", "optim_grads", "optim_grads_params")
        if self.data_parallel_sharding_strategy not in strategies:
            raise field_error(
                self,
                "data_parallel_sharding_strategy",
                self.data_parallel_sharding_strategy,
                f"expected one of {', '.join(repr(s) for s in strategies)}",
            )
