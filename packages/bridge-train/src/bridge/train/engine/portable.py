"""The portable engine: megatron-core models trained on CPU (gloo) or GPU (nccl).

* model: the provider's megatron ``GPTModel`` (on CPU its layer spec uses torch SDPA
  attention; tensor parallelism is megatron-core's own, over any backend);
* data parallelism: :class:`~bridge.train.engine.portable_ddp.PortableDistributedDataParallel`
  (flat gradient buckets all-reduced once per step, driven by megatron's
  ``finalize_model_grads``);
* optimizer: :class:`~bridge.train.engine.portable_optimizer.PortableOptimizer` (a torch
  optimizer behind megatron's optimizer contract) and megatron's
  ``OptimizerParamScheduler``;
* schedule: :func:`~bridge.train.engine.portable_schedule.forward_backward_no_pipelining`.

Not available here (use the megatron engine on CUDA): pipeline parallelism, the
distributed optimizer, megatron FSDP; on CPU also sequence and context parallelism.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from bridge.train.engine._model_setup import build_model_chunks, cast_for_precision
from bridge.train.engine.initialize import initialize_distributed, validate_parallel_layout
from bridge.train.engine.portable_ddp import PortableDistributedDataParallel
from bridge.train.engine.portable_optimizer import build_portable_optimizer
from bridge.train.engine.portable_schedule import forward_backward_no_pipelining
from bridge.train.engine.scheduler import build_optimizer_param_scheduler
from core_utils.distributed import global_world_size

__all__ = ["PortableEngine"]


class PortableEngine:
    """Engine for CPU (gloo) and GPU (nccl) without megatron's CUDA-only training stack."""

    name = "portable"

    @property
    def device(self) -> torch.device:
        """``cuda:<current>`` when CUDA is available, else ``cpu``."""
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def initialize_distributed(
        self, model_config: Any, dist_config: Any = None, rng_config: Any = None
    ) -> None:
        """See :func:`bridge.train.engine.initialize.initialize_distributed` (validated for this engine)."""
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
        """Build this rank's model chunk and wrap it for data parallelism.

        Args:
            model_provider: A provider with ``provide()`` that is also the model config
                (:class:`~bridge.train.GPTModelProvider`).
            ddp_config: megatron's ``DistributedDataParallelConfig`` (defaults when None).
            wrap_with_ddp: Wrap in :class:`PortableDistributedDataParallel` and install its
                ``no_sync`` / ``finalize_model_grads`` hooks on the model config.
            pre_wrap_hooks: Called with the list of chunks before wrapping (for example
                :func:`~bridge.train.create_value_head_hook`); a hook may return a new list.
            data_parallel_random_init: Parameters differ per data-parallel rank; they are
                broadcast from data-parallel rank 0 after wrapping.
            optimizer_config: The optimizer config; unused here (the megatron engine reads
                its parameter-gather overlap setting).

        Returns:
            A one-element list of model chunks.

        Raises:
            ValueError: The config asks for something this engine does not do (pipeline
                parallelism, distributed optimizer, sequence parallelism on CPU).
        """
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads

        world = global_world_size()
        validate_parallel_layout(model_provider, world, self.name)
        ddp_config = ddp_config if ddp_config is not None else DistributedDataParallelConfig()
        if wrap_with_ddp:
            # Fail on unsupported DDP options before building the model.
            from bridge.train.engine.portable_ddp import _refuse_unsupported

            _refuse_unsupported(ddp_config)
        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError(
                "setup_model needs megatron's parallel state: call engine.initialize_distributed first"
            )
        chunks = build_model_chunks(model_provider, None, pre_wrap_hooks)
        device = self.device
        chunks = [chunk.to(device) for chunk in chunks]
        chunks = cast_for_precision(chunks, model_provider)
        if not wrap_with_ddp:
            return chunks
        wrapped: list[torch.nn.Module] = [
            PortableDistributedDataParallel(model_provider, ddp_config, chunk) for chunk in chunks
        ]
        if data_parallel_random_init:
            for chunk in wrapped:
                chunk.broadcast_params()  # type: ignore[operator]
        model_provider.no_sync_func = wrapped[0].no_sync
        model_provider.finalize_model_grads_func = finalize_model_grads
        return wrapped

    def setup_optimizer(
        self,
        model: list[torch.nn.Module],
        optimizer_config: Any,
        scheduler_config: Any,
        train_config: Any = None,
    ) -> tuple[Any, Any]:
        """Build the :class:`PortableOptimizer` and megatron's ``OptimizerParamScheduler``.

        Args:
            model: The chunks from :meth:`setup_model`.
            optimizer_config: megatron's ``OptimizerConfig``.
            scheduler_config: ``SchedulerConfig``.
            train_config: ``TrainingConfig`` (``train_iters``, ``global_batch_size``) for step
                counts the scheduler config leaves unset.

        Returns:
            ``(optimizer, scheduler)``.
        """
        optimizer = build_portable_optimizer(model, optimizer_config)
        scheduler = build_optimizer_param_scheduler(
            optimizer, optimizer_config, scheduler_config, train_config
        )
        model_config = _model_config(model)
        if model_config is not None:
            model_config.grad_scale_func = optimizer.scale_loss if optimizer_config.fp16 else None
        return optimizer, scheduler

    @property
    def forward_backward_func(self) -> Callable[..., list[Any]]:
        """:func:`~bridge.train.engine.portable_schedule.forward_backward_no_pipelining`."""
        return forward_backward_no_pipelining


def _model_config(model: list[torch.nn.Module]) -> Any:
    from megatron.core.utils import get_model_config

    try:
        return get_model_config(model[0])
    except RuntimeError:
        return None
