"""The engine seam: what the training loop needs from an execution engine.

The loop never reaches into the engine's machinery; it asks :func:`build_engine` for the
engine and then only calls the members of :class:`Engine`. There is one engine,
:class:`~bridge.train.engine.megatron.MegatronEngine`: megatron-core's DDP, optimizers
(including the distributed optimizer) and pipeline schedules, on CUDA and, under
:func:`core_utils.cuda_emulation`, on CPU with gloo. The seam stays because it keeps the
loop readable: a handful of calls in a fixed order, not megatron-core's whole surface.

See ``docs/engines.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from bridge.train.engine.megatron import MegatronEngine

if TYPE_CHECKING:
    from bridge.config import (
        DDPConfigProtocol,
        DistributedInitConfig,
        ModelConfigProtocol,
        OptimizerConfigProtocol,
        RNGConfig,
        SchedulerConfig,
        TrainingConfig,
    )

__all__ = ["Engine", "build_engine"]


@runtime_checkable
class Engine(Protocol):
    """What the training loop calls on an engine, in this order.

    1. :meth:`initialize_distributed` once per process;
    2. :meth:`setup_model` to build and wrap the model chunks;
    3. :meth:`setup_optimizer` to build the megatron-contract optimizer and scheduler;
    4. :attr:`forward_backward_func` every iteration (and for evaluation with
       ``forward_only=True``).
    """

    name: str
    """The engine's name (``"megatron"``), for logs and reports."""

    @property
    def device(self) -> torch.device:
        """Device the model and batches live on."""
        ...

    def initialize_distributed(
        self,
        model_config: ModelConfigProtocol,
        dist_config: DistributedInitConfig | None = None,
        rng_config: RNGConfig | None = None,
    ) -> None:
        """Bring up torch.distributed, megatron's parallel state and the RNG seeds."""
        ...

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
    ) -> list[torch.nn.Module]:
        """Build the model chunks of this rank, move them to the device, wrap them for DP.

        With ``layout_independent_seed`` the weights are drawn from that seed and each
        tensor's global identity (:mod:`bridge.train.models.layout_init`), before the hooks.

        Also sets the model config's ``no_sync_func`` and ``finalize_model_grads_func`` so
        the schedule drives gradient reduction.
        """
        ...

    def setup_optimizer(
        self,
        model: list[torch.nn.Module],
        optimizer_config: OptimizerConfigProtocol,
        scheduler_config: SchedulerConfig,
        train_config: TrainingConfig | None = None,
    ) -> tuple[Any, Any]:
        """Return ``(optimizer, scheduler)``: a megatron-contract optimizer and megatron's
        ``OptimizerParamScheduler`` (also sets the model config's ``grad_scale_func``)."""
        ...

    @property
    def forward_backward_func(self) -> Callable[..., list[Any]]:
        """A function with megatron-core's ``forward_backward_func`` signature."""
        ...


def build_engine() -> Engine:
    """Create the engine: megatron-core's (:class:`~bridge.train.engine.megatron.MegatronEngine`).

    Building it changes no process state; without CUDA the engine enters the CUDA emulation
    only in ``initialize_distributed``.

    Returns:
        The engine.
    """

    return MegatronEngine()
