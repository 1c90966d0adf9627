"""Megatron-style data parallelism that runs on any device and any torch.distributed backend.

:class:`PortableDistributedDataParallel` wraps one model chunk the way megatron-core's
``DistributedDataParallel`` does, without its CUDA-only grad buffers:

* every trainable parameter gets a ``main_grad``: a view into a flat gradient buffer
  (fp32 when ``ddp_config.grad_reduce_in_fp32``, else the parameter dtype);
* a post-accumulate-grad hook adds each fresh ``param.grad`` into ``main_grad`` and frees
  ``param.grad``, so gradients accumulate over micro-batches in the buffer;
* the buffer is split into buckets that are all-reduced over the data-parallel group
  (expert parameters over the expert data-parallel group) once per step, pre-scaled by
  ``1 / data_parallel_size`` (unless the loss is per-token, in which case
  ``finalize_model_grads`` divides by the global token count);
* with ``overlap_grad_reduce`` a bucket's all-reduce is launched asynchronously as soon as
  all its parameters have their last micro-batch gradient, overlapping communication with
  the rest of the backward pass; ``no_sync()`` marks the micro-batches before the last.

It exposes the methods megatron-core's schedule and ``finalize_model_grads`` call
(``no_sync``, ``start_grad_sync``, ``finish_grad_sync``, ``scale_gradients``,
``zero_grad_buffer``, ``broadcast_params``, ``ddp_config``, ``module``), so megatron's own
``finalize_model_grads`` drives it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from core_utils.distributed import global_rank
from core_utils.process_groups import get_pg_size

__all__ = ["PortableDistributedDataParallel"]

_DEFAULT_MIN_BUCKET_SIZE = 40_000_000


@dataclass(eq=False)
class _Bucket:
    """A contiguous slice of a gradient buffer reduced with one collective."""

    grad_data: torch.Tensor
    params: list[torch.nn.Parameter]
    group: Any
    scaling_factor: float
    pending: set[int] = field(default_factory=set)
    handle: Any = None
    launched: bool = False

    def reset(self) -> None:
        self.pending = {id(p) for p in self.params}
        self.handle = None
        self.launched = False


class PortableDistributedDataParallel(torch.nn.Module):
    """Wrap a model chunk for data-parallel training with megatron's DDP interface.

    Args:
        config: The model's ``TransformerConfig`` (``calculate_per_token_loss`` is read).
        ddp_config: megatron's ``DistributedDataParallelConfig``. Supported:
            ``grad_reduce_in_fp32``, ``overlap_grad_reduce``, ``bucket_size``,
            ``average_in_collective`` (emulated as pre-scaling plus a sum, identical in
            result), ``check_for_nan_in_grad``. The distributed optimizer and megatron FSDP
            need the megatron engine and are refused.
        module: The model chunk.
        data_parallel_group: Group dense gradients are reduced over (default: megatron's
            data-parallel group including context parallelism).
        expert_data_parallel_group: Group expert gradients are reduced over (default:
            megatron's expert data-parallel group).

    Raises:
        ValueError: ``ddp_config`` asks for a feature only the megatron engine has.
    """

    def __init__(
        self,
        config: Any,
        ddp_config: Any,
        module: torch.nn.Module,
        *,
        data_parallel_group: Any = None,
        expert_data_parallel_group: Any = None,
    ) -> None:
        super().__init__()
        _refuse_unsupported(ddp_config)
        self.module = module
        self.config = config
        self.ddp_config = ddp_config
        if data_parallel_group is None or expert_data_parallel_group is None:
            from megatron.core import parallel_state

            if data_parallel_group is None:
                data_parallel_group = parallel_state.get_data_parallel_group(
                    with_context_parallel=True
                )
            if expert_data_parallel_group is None:
                expert_data_parallel_group = parallel_state.get_expert_data_parallel_group(
                    check_initialized=False
                )
                if expert_data_parallel_group is None:
                    expert_data_parallel_group = data_parallel_group
        self.data_parallel_group = data_parallel_group
        self.expert_data_parallel_group = expert_data_parallel_group
        dp_size = get_pg_size(data_parallel_group)
        # With a per-token loss finalize_model_grads divides by the global token count.
        per_token = getattr(config, "calculate_per_token_loss", False)
        scaling = 1.0 if per_token else 1.0 / dp_size
        bucket_size = ddp_config.bucket_size
        if bucket_size is None:
            bucket_size = max(_DEFAULT_MIN_BUCKET_SIZE, 1_000_000 * dp_size)
        self._is_last_microbatch = True
        self.grad_buffers: list[torch.Tensor] = []
        self.buckets: list[_Bucket] = []
        self._param_to_bucket: dict[int, _Bucket] = {}
        self.params_with_grad: list[torch.nn.Parameter] = []
        self._build_buffers(scaling, int(bucket_size))
        self._hook_handles = [
            param.register_post_accumulate_grad_hook(self._make_grad_hook(param))
            for param in self.params_with_grad
        ]

    # -- construction -------------------------------------------------------------------
    def _grad_dtype(self, param: torch.nn.Parameter) -> torch.dtype:
        return torch.float32 if self.ddp_config.grad_reduce_in_fp32 else param.dtype

    def _build_buffers(self, scaling: float, bucket_size: int) -> None:
        groups: dict[tuple[torch.dtype, torch.device, bool], list[torch.nn.Parameter]] = {}
        # Reverse order approximates the order gradients become ready in backward.
        for param in reversed(list(self.module.parameters())):
            if not param.requires_grad:
                continue
            is_expert = not getattr(param, "allreduce", True)
            key = (self._grad_dtype(param), param.device, is_expert)
            groups.setdefault(key, []).append(param)
            self.params_with_grad.append(param)
        for (dtype, device, is_expert), params in groups.items():
            total = sum(p.numel() for p in params)
            buffer = torch.zeros(total, dtype=dtype, device=device)
            self.grad_buffers.append(buffer)
            group = self.expert_data_parallel_group if is_expert else self.data_parallel_group
            offset = 0
            bucket_start = 0
            bucket_params: list[torch.nn.Parameter] = []
            for index, param in enumerate(params):
                param.main_grad = buffer[offset : offset + param.numel()].view(param.shape)  # type: ignore[attr-defined]
                param.grad_added_to_main_grad = False  # type: ignore[attr-defined]
                offset += param.numel()
                bucket_params.append(param)
                if offset - bucket_start >= bucket_size or index == len(params) - 1:
                    bucket = _Bucket(buffer[bucket_start:offset], bucket_params, group, scaling)
                    bucket.reset()
                    self.buckets.append(bucket)
                    for p in bucket_params:
                        self._param_to_bucket[id(p)] = bucket
                    bucket_start, bucket_params = offset, []

    def _make_grad_hook(self, param: torch.nn.Parameter) -> Any:
        def hook(p: torch.Tensor) -> None:
            if p.grad is not None and not getattr(p, "grad_added_to_main_grad", False):
                p.main_grad.add_(p.grad)  # type: ignore[attr-defined]
            p.grad = None
            if self.ddp_config.overlap_grad_reduce and self._is_last_microbatch:
                bucket = self._param_to_bucket[id(param)]
                bucket.pending.discard(id(param))
                if not bucket.pending and not bucket.launched:
                    self._launch(bucket, async_op=True)

        return hook

    # -- communication -----------------------------------------------------------------
    def _launch(self, bucket: _Bucket, async_op: bool) -> None:
        if self.ddp_config.check_for_nan_in_grad and not torch.isfinite(bucket.grad_data).all():
            rank = global_rank()
            raise RuntimeError(
                f"rank {rank}: non-finite gradient found before the data-parallel reduction "
                f"(ddp.check_for_nan_in_grad=True)"
            )
        bucket.launched = True
        if bucket.scaling_factor != 1.0:
            bucket.grad_data.mul_(bucket.scaling_factor)
        if get_pg_size(bucket.group) > 1:
            bucket.handle = dist.all_reduce(bucket.grad_data, group=bucket.group, async_op=async_op)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without starting their reduction (all but the last micro-batch)."""
        self._is_last_microbatch = False
        try:
            yield
        finally:
            self._is_last_microbatch = True

    def start_grad_sync(self, *unused: Any) -> None:
        """Launch the reduction of every bucket not launched yet (async with overlap)."""
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket, async_op=self.ddp_config.overlap_grad_reduce)

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        """Finish every bucket's reduction; afterwards ``main_grad`` holds the averaged grads.

        Args:
            force_all_reduce: Accepted for megatron compatibility; this wrapper always
                all-reduces.
        """
        del force_all_reduce
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket, async_op=False)
            if bucket.handle is not None:
                bucket.handle.wait()
                bucket.handle = None

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply every gradient buffer by ``scaling_factor``."""
        for buffer in self.grad_buffers:
            buffer.mul_(scaling_factor)

    def zero_grad_buffer(self) -> None:
        """Zero the gradient buffers; call at the start of every training iteration."""
        for param in self.params_with_grad:
            param.grad_added_to_main_grad = False  # type: ignore[attr-defined]
        for buffer in self.grad_buffers:
            buffer.zero_()
        for bucket in self.buckets:
            bucket.reset()

    def broadcast_params(self) -> None:
        """Copy the parameters of data-parallel rank 0 to every data-parallel rank."""
        for param in self.module.parameters():
            is_expert = not getattr(param, "allreduce", True)
            group = self.expert_data_parallel_group if is_expert else self.data_parallel_group
            if get_pg_size(group) > 1:
                dist.broadcast(param.data, src=dist.get_global_rank(group, 0), group=group)

    # -- module interface --------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module."""
        return self.module(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's state dict (no ``module.`` prefix)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load into the wrapped module (same keys as :meth:`state_dict`)."""
        if assign:
            return self.module.load_state_dict(state_dict, strict=strict, assign=True)
        # megatron's Float16Module (bf16/fp16 models) has no ``assign`` parameter.
        return self.module.load_state_dict(state_dict, strict=strict)

    def sharded_state_dict(self, prefix: str = "", *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's megatron ``sharded_state_dict`` (for dist_checkpointing)."""
        return self.module.sharded_state_dict(prefix, *args, **kwargs)  # type: ignore[operator]


def _refuse_unsupported(ddp_config: Any) -> None:
    refused = {
        "use_distributed_optimizer": "the distributed optimizer",
        "use_megatron_fsdp": "megatron FSDP",
        "use_custom_fsdp": "megatron FSDP",
        "overlap_param_gather": "overlapped parameter all-gather (distributed optimizer)",
    }
    for name, what in refused.items():
        if getattr(ddp_config, name, False):
            raise ValueError(
                f"ddp.{name}=True: {what} needs the megatron engine on CUDA "
                f"(train.engine='megatron'); set ddp.{name}=False for the portable engine"
            )
    instances = getattr(ddp_config, "num_distributed_optimizer_instances", 1)
    if instances != 1:
        raise ValueError(
            f"ddp.num_distributed_optimizer_instances={instances} needs the megatron engine; "
            "set it to 1 for the portable engine"
        )
