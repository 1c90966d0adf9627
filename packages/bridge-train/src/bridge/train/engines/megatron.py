"""The megatron engine: megatron-core's own training stack, for CUDA.

* data parallelism: megatron-core ``DistributedDataParallel`` (grad buffers, overlapped
  reduce-scatter / all-reduce, optional distributed optimizer and parameter all-gather);
* optimizer: ``get_megatron_optimizer`` (fused Adam/SGD from Transformer Engine or Apex when
  installed, mixed precision, distributed optimizer);
* schedule: ``get_forward_backward_func()`` (1F1B and interleaved pipeline schedules);
* layer specs: Transformer Engine when the ``te`` extra is installed (see
  ``GPTModelProvider.layer_spec_backend``).

Every one of these allocates on CUDA, so the engine refuses to start without it, before any
process group or model exists. This module cannot be exercised on a CPU-only machine beyond
that refusal; its construction code follows megatron-core 0.19's APIs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from bridge.train.engines._model_setup import build_model_chunks, cast_for_precision
from bridge.train.initialize import initialize_distributed, validate_parallel_layout
from bridge.train.scheduler import build_optimizer_param_scheduler

__all__ = ["MegatronEngine"]


class MegatronEngine:
    """Engine on megatron-core's DDP, distributed optimizer and pipeline schedules (CUDA).

    Raises:
        RuntimeError: CUDA is not available (raised by the constructor).
    """

    name = "megatron"

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "train.engine='megatron' requires CUDA (megatron-core's DDP, optimizer and "
                "pipeline schedules allocate on the GPU), and no GPU is available; use the "
                "portable engine on CPU: train.engine='portable'"
            )

    @property
    def device(self) -> torch.device:
        """The current CUDA device."""
        return torch.device("cuda", torch.cuda.current_device())

    def initialize_distributed(
        self, model_config: Any, dist_config: Any = None, rng_config: Any = None
    ) -> None:
        """See :func:`bridge.train.initialize_distributed` (nccl, all parallelisms)."""
        initialize_distributed(model_config, dist_config, rng_config, engine=self.name)

    def setup_model(
        self,
        model_provider: Any,
        ddp_config: Any = None,
        *,
        wrap_with_ddp: bool = True,
        pre_wrap_hooks: Sequence[Callable[[list[torch.nn.Module]], Any]] = (),
        data_parallel_random_init: bool = False,
        optimizer_config: Any = None,
    ) -> list[torch.nn.Module]:
        """Build one chunk per virtual pipeline stage and wrap them in megatron's DDP.

        Sets ``no_sync_func``, ``grad_sync_func``, ``param_sync_func`` (distributed optimizer
        with overlapped all-gather) and ``finalize_model_grads_func`` on the model config, as
        megatron's training loop does.
        """
        from megatron.core import parallel_state
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        validate_parallel_layout(model_provider, torch.distributed.get_world_size(), self.name)
        if ddp_config is None:
            ddp_config = DistributedDataParallelConfig()
        elif not isinstance(ddp_config, DistributedDataParallelConfig):
            from bridge.config import convert_dataclass

            # bridge.config's DDP section mirrors megatron's field names.
            ddp_config = convert_dataclass(ddp_config, DistributedDataParallelConfig)
        vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
        chunks = build_model_chunks(model_provider, vp_size, pre_wrap_hooks)
        chunks = [chunk.cuda(torch.cuda.current_device()) for chunk in chunks]
        chunks = cast_for_precision(chunks, model_provider)
        if not wrap_with_ddp:
            return chunks
        wrapped = [
            DistributedDataParallel(
                config=model_provider,
                ddp_config=ddp_config,
                module=chunk,
                # As megatron's training: only the first chunk is bucketed, and not at all
                # when the parameter all-gather overlaps the optimizer step.
                disable_bucketing=(index > 0)
                or bool(
                    getattr(optimizer_config, "overlap_param_gather_with_optimizer_step", False)
                ),
            )
            for index, chunk in enumerate(chunks)
        ]
        if data_parallel_random_init:
            for chunk in wrapped:
                chunk.broadcast_params()
        no_sync = [chunk.no_sync for chunk in wrapped]
        model_provider.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        if ddp_config.overlap_grad_reduce:
            # Pipeline stages launch their grad reductions aligned (dist.align_grad_reduce).
            grad_sync = [chunk.start_grad_sync for chunk in wrapped]
            model_provider.grad_sync_func = grad_sync[0] if len(grad_sync) == 1 else grad_sync
        if ddp_config.overlap_param_gather and ddp_config.align_param_gather:
            param_sync = [chunk.start_param_sync for chunk in wrapped]
            model_provider.param_sync_func = param_sync[0] if len(param_sync) == 1 else param_sync
        model_provider.finalize_model_grads_func = finalize_model_grads
        return wrapped

    def setup_optimizer(
        self,
        model: list[torch.nn.Module],
        optimizer_config: Any,
        scheduler_config: Any,
        train_config: Any = None,
    ) -> tuple[Any, Any]:
        """``get_megatron_optimizer`` and megatron's ``OptimizerParamScheduler``."""
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.utils import get_model_config

        optimizer = get_megatron_optimizer(optimizer_config, model)
        scheduler = build_optimizer_param_scheduler(
            optimizer, optimizer_config, scheduler_config, train_config
        )
        get_model_config(model[0]).grad_scale_func = optimizer.scale_loss
        return optimizer, scheduler

    @property
    def forward_backward_func(self) -> Callable[..., list[Any]]:
        """megatron-core's schedule for the current pipeline layout."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()
