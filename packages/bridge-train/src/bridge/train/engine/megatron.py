"""The engine: megatron-core's own training stack, on CUDA and on CPU.

megatron-core's ``DistributedDataParallel`` (optionally with the distributed optimizer),
``get_megatron_optimizer`` (Transformer Engine's or Apex's fused kernels when installed) and
``get_forward_backward_func`` (1F1B and interleaved pipeline schedules). Every one of them
assumes CUDA: without a GPU, :meth:`MegatronEngine.initialize_distributed` enters
:func:`core_utils.cuda_emulation` for the run (:mod:`~bridge.train.engine.initialize`) and
the same code path runs on the CPU with gloo and the portable layer spec (SDPA core
attention). See ``docs/engines.md`` for what the emulation covers and the layouts verified
on CPU. It is the one engine: the loop holds it as :data:`Engine`, from :func:`build_engine`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from megatron.core import parallel_state, utils as megatron_utils
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import clip_grads, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import set_defaults_if_not_set_tensor_model_parallel_attributes
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_model_config

from bridge.config import convert_dataclass, data_parallel_size
from bridge.train.engine._distributed_utils import unwrap_model_chunks
from bridge.train.engine.initialize import initialize_distributed
from bridge.train.engine.scheduler import build_optimizer_param_scheduler
from bridge.train.models.layout_init import check_supported, initialize_layout_independent
from core_utils import cuda_emulation_active, local_multi_tensor_l2_norm

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer

    from bridge.config import (
        DDPConfigProtocol,
        DistributedInitConfig,
        ModelConfigProtocol,
        OptimizerConfigProtocol,
        RNGConfig,
        SchedulerConfig,
        TrainingConfig,
    )

__all__ = [
    "Engine",
    "MegatronEngine",
    "build_engine",
    "skip_non_finite_updates",
    "use_sync_free_grad_norm",
]


class MegatronEngine:
    """Engine on megatron-core's DDP, distributed optimizer and pipeline schedules.

    On CUDA with nccl; without CUDA on the CPU with gloo, under
    :func:`core_utils.cuda_emulation` (entered by :meth:`initialize_distributed`).
    """

    name = "megatron"

    @property
    def device(self) -> torch.device:
        """The current CUDA device, or ``cpu`` without CUDA (under the emulation)."""
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def initialize_distributed(
        self,
        model_config: ModelConfigProtocol,
        dist_config: DistributedInitConfig | None = None,
        rng_config: RNGConfig | None = None,
    ) -> None:
        """See :func:`bridge.train.engine.initialize.initialize_distributed`; without CUDA it
        enters the CUDA emulation for the rest of the run."""
        initialize_distributed(model_config, dist_config, rng_config, emulate_cuda=True)

    def setup_model(
        self,
        model_provider: Any,
        ddp_config: DDPConfigProtocol | None = None,
        *,
        wrap_with_ddp: bool = True,
        pre_wrap_hooks: Sequence[Callable[[list[torch.nn.Module]], Any]] = (),
        data_parallel_random_init: bool = False,
        optimizer_config: OptimizerConfigProtocol | None = None,
        layout_independent_seed: int | None = None,
        align_grad_reduce: bool = True,
    ) -> list[torch.nn.Module]:
        """Build one chunk per virtual pipeline stage and wrap them in megatron's DDP.

        With ``layout_independent_seed`` (``rng.layout_independent_init``) every weight is
        drawn from that seed and its global identity, the same under every layout
        (:func:`~bridge.train.models.layout_init.initialize_layout_independent`), before
        ``pre_wrap_hooks`` run; megatron's own draw is skipped. ``data_parallel_random_init``
        cannot be combined with it.

        Sets ``no_sync_func``, ``grad_sync_func`` (overlapped grad reduction with
        ``align_grad_reduce``, ``dist.align_grad_reduce``), ``param_sync_func`` (distributed
        optimizer with overlapped all-gather) and ``finalize_model_grads_func`` on the model
        config, as megatron's training loop does.
        """

        data_parallel_size(model_provider, torch.distributed.get_world_size())
        if not isinstance(ddp_config, DistributedDataParallelConfig):
            # bridge.config's DDP section mirrors megatron's field names (None: the defaults).
            ddp_config = convert_dataclass(ddp_config, DistributedDataParallelConfig)
        vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
        if layout_independent_seed is not None and data_parallel_random_init:
            raise ValueError(
                "rng.layout_independent_init and rng.data_parallel_random_init exclude each "
                "other: set one to false"
            )
        # Drawn layout-independently, the chunks are built without megatron's own draw; a
        # provider whose perform_initialization is already off (weights loaded later) is
        # left undrawn, as megatron would.
        draw = layout_independent_seed is not None and bool(
            getattr(model_provider, "perform_initialization", True)
        )
        if draw:
            check_supported(model_provider)
            model_provider.perform_initialization = False
        try:
            if vp_size is None:
                chunks = [model_provider.provide()]
            else:
                chunks = [model_provider.provide(vp_stage=stage) for stage in range(vp_size)]
        finally:
            if draw:
                model_provider.perform_initialization = True
        if layout_independent_seed is not None and draw:
            initialize_layout_independent(chunks, model_provider, layout_independent_seed)
        for hook in pre_wrap_hooks:
            result = hook(chunks)
            if result is not None:
                chunks = unwrap_model_chunks(result)
        # megatron's distributed checkpointing and schedules expect this attribute.
        for chunk in chunks:
            for param in chunk.parameters():
                set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        # Under the CUDA emulation .cuda() keeps the CPU tensors where they are.
        chunks = [chunk.cuda(torch.cuda.current_device()) for chunk in chunks]
        if getattr(model_provider, "bf16", False) or getattr(model_provider, "fp16", False):
            # megatron's Float16Module casts the inputs in and returns fp32.
            chunks = [Float16Module(model_provider, chunk) for chunk in chunks]
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
        if ddp_config.overlap_grad_reduce and align_grad_reduce:
            # megatron-training's rule: with a grad_sync_func the pipeline schedule launches
            # each stage's reduction when that stage's backward ends; without one, megatron's
            # DDP launches every bucket from its own backward hooks, all stages at once.
            grad_sync = [chunk.start_grad_sync for chunk in wrapped]
            model_provider.grad_sync_func = grad_sync[0] if len(grad_sync) == 1 else grad_sync
        if ddp_config.overlap_param_gather and getattr(ddp_config, "align_param_gather", False):
            param_sync = [chunk.start_param_sync for chunk in wrapped]
            model_provider.param_sync_func = param_sync[0] if len(param_sync) == 1 else param_sync
        model_provider.finalize_model_grads_func = finalize_model_grads
        return wrapped

    def setup_optimizer(
        self,
        model: list[torch.nn.Module],
        optimizer_config: OptimizerConfigProtocol,
        scheduler_config: SchedulerConfig,
        train_config: TrainingConfig | None = None,
    ) -> tuple[Any, Any]:
        """``get_megatron_optimizer`` and megatron's ``OptimizerParamScheduler``.

        The optimizer skips (and reports as skipped) an update whose gradient norm is not
        finite, as it does for an fp16 loss-scale overflow: see :func:`skip_non_finite_updates`.
        """

        use_sync_free_grad_norm()
        optimizer = get_megatron_optimizer(
            optimizer_config, model, use_gloo_process_groups=_gloo_groups_exist()
        )
        skip_non_finite_updates(optimizer)
        scheduler = build_optimizer_param_scheduler(
            optimizer, optimizer_config, scheduler_config, train_config
        )
        get_model_config(model[0]).grad_scale_func = optimizer.scale_loss
        return optimizer, scheduler

    @property
    def forward_backward_func(self) -> Callable[..., list[Any]]:
        """megatron-core's schedule for the current pipeline layout.

        With a virtual pipeline megatron's interleaved schedule wants one data iterator per
        model chunk; a single iterator is split (``itertools.tee``) so that every chunk sees
        the same micro-batches and the iterator advances by ``num_microbatches`` per call,
        as without a virtual pipeline.

        Raises:
            RuntimeError: No CUDA and the CUDA emulation is not active (megatron-core's
                schedules place tensors on ``"cuda"``): :meth:`initialize_distributed` enters
                it, or run the loop inside ``with core_utils.cuda_emulation():``.
        """

        if not torch.cuda.is_available() and not cuda_emulation_active():
            raise RuntimeError(
                "megatron-core's forward-backward schedules need CUDA, or on CPU the CUDA "
                "emulation: call engine.initialize_distributed(...) first (it enters it for "
                "the run), or run inside `with core_utils.cuda_emulation():`"
            )

        schedule = get_forward_backward_func()
        vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
        if not vp_size or vp_size <= 1:
            return schedule

        def forward_backward_per_chunk(*, data_iterator: Any = None, **kwargs: Any) -> list[Any]:
            if data_iterator is not None and not isinstance(data_iterator, list):
                # megatron's RerunDataIterator (what the trainer hands the schedule) has
                # __next__ but no __iter__, which tee needs; iter(callable, sentinel) ends at
                # the StopIteration the callable raises.
                items = iter(data_iterator.__next__, object())
                data_iterator = list(itertools.tee(items, vp_size))
            return schedule(data_iterator=data_iterator, **kwargs)

        return forward_backward_per_chunk


Engine = MegatronEngine
"""The type of the engine the loop holds (megatron-core's is the only one)."""


def build_engine() -> Engine:
    """Create the engine: megatron-core's (:class:`MegatronEngine`); building it changes no
    process state (without CUDA the emulation starts in ``initialize_distributed``)."""
    return MegatronEngine()


def skip_non_finite_updates(optimizer: MegatronOptimizer) -> None:
    """Make megatron's optimizer skip an update whose global gradient norm is NaN or inf.

    megatron-core's optimizers find non-finite gradients only under fp16 loss scaling;
    in fp32 and bf16 they step on them, and a single NaN gradient reaches every weight
    (Megatron-LM stops the run instead, with ``--check-for-nan-in-loss-and-grad``). Here the
    update is skipped and ``step()`` returns ``(False, grad_norm, num_zeros)``, as for a
    loss-scale overflow, so the loop counts a skipped iteration and does not advance the
    scheduler. The norm is the one megatron's ``ChainedOptimizer.step`` computes anyway
    (already on the host), so this costs no extra synchronisation; it is recorded by a
    wrapper around the optimizer's ``get_grad_norm`` and checked by one around its
    ``step_with_ready_grads`` (both are called by ``step``, in that order).

    Args:
        optimizer: ``get_megatron_optimizer``'s result (a ``ChainedOptimizer``).
    """
    get_grad_norm = optimizer.get_grad_norm
    step_with_ready_grads = optimizer.step_with_ready_grads
    last_norm: list[Any] = [None]

    def recording_get_grad_norm() -> Any:
        last_norm[0] = get_grad_norm()
        return last_norm[0]

    def guarded_step_with_ready_grads() -> bool:
        norm, last_norm[0] = last_norm[0], None
        if norm is not None and not math.isfinite(float(norm)):
            return False
        return bool(step_with_ready_grads())

    optimizer.get_grad_norm = recording_get_grad_norm
    optimizer.step_with_ready_grads = guarded_step_with_ready_grads


def use_sync_free_grad_norm() -> None:
    """Give megatron's grad clipping core-utils' L2 norm where it would use its own fallback.

    Without Transformer Engine or Apex, megatron-core 0.19.2 computes the gradient norm with
    ``megatron.core.utils.local_multi_tensor_l2_norm``, which builds a host tensor from one
    norm per parameter: one device synchronisation per parameter tensor on every step (56 per
    iteration of the tiny GPT on the first GPU run, docs/gpu.md). core-utils' stand-in has the
    same signature and result and keeps every norm on the device. Installed fallbacks of
    Transformer Engine or Apex are kept.
    """
    if clip_grads.l2_norm_impl is megatron_utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = local_multi_tensor_l2_norm


def _gloo_groups_exist() -> bool:
    """Whether megatron's parallel state built gloo duplicates of the data-parallel groups.

    :func:`~bridge.train.engine.initialize.initialize_distributed` builds them only on an nccl world (on a
    gloo world the regular groups already are gloo groups).
    """

    try:
        return parallel_state.get_data_parallel_group_gloo(with_context_parallel=True) is not None
    except AssertionError:
        return False
