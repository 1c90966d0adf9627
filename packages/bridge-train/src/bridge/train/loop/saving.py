"""The loop's checkpoint writer: a save with the run's bookkeeping around it.

:class:`CheckpointWriter` is the :data:`~bridge.train.loop.components.SaveFunction` of GPT
training and of the MIMO recipe. Around
:func:`~bridge.train.checkpointing.write_checkpoint` (the ``checkpoint`` section, the
counters, model, optimizer, scheduler and run config) it flushes the metric writers (records
of the saved steps reach disk before the checkpoint commits), pauses the iteration timer,
disables megatron's forward pre-hooks while whole parameters are read, opens a
fault-tolerance checkpointing section and, after a persistent save, appends the throughput
line of ``progress.txt``. The :class:`~bridge.train.loop.components.Checkpointer` decides
when it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from bridge.config import CheckpointConfig
from bridge.logging import MetricWriters
from bridge.resiliency import FaultTolerance, NullFaultTolerance
from bridge.train.checkpointing.save import RunConfigFile, write_checkpoint
from bridge.train.loop.forward_pre_hooks import disable_forward_pre_hook, enable_forward_pre_hook
from bridge.train.loop.progress_log import ProgressLog
from core_utils import Timers
from core_utils.loop import LoopContext, TrainProgress

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

__all__ = ["CheckpointWriter"]


@dataclass
class CheckpointWriter:
    """Writes the loop's checkpoints (see the module docstring).

    Attributes:
        checkpoint: The ``checkpoint`` section.
        run_config: Saved beside the weights as ``run_config.yaml``.
        checkpointing_context: From
            :func:`~bridge.train.checkpointing.init_checkpointing_context` (kept between
            saves).
        metric_writers: Flushed before every save.
        fault_tolerance: Every save is a checkpointing section.
        timers: The run's timers (``save-checkpoint`` is timed, ``interval-time`` paused);
            ``None``: not timed.
        toggle_forward_pre_hooks: Disable megatron's forward pre-hooks around the save.
        progress_log: ``progress.txt`` (``logger.log_progress``), if kept.
    """

    checkpoint: CheckpointConfig
    run_config: RunConfigFile | None
    checkpointing_context: dict[str, Any] = field(default_factory=dict)
    metric_writers: MetricWriters = field(default_factory=MetricWriters)
    fault_tolerance: FaultTolerance = field(default_factory=NullFaultTolerance)
    timers: Timers | None = None
    toggle_forward_pre_hooks: bool = False
    progress_log: ProgressLog | None = None

    def save(
        self,
        train_state: Any,
        model: list[torch.nn.Module],
        optimizer: MegatronOptimizer | None,
        scheduler: OptimizerParamScheduler | None,
        flops_so_far: float,
        *,
        non_persistent: bool = False,
    ) -> None:
        """Save a checkpoint of iteration ``train_state.step`` (a collective).

        Args:
            train_state: The run's ``TrainState`` (saved).
            model: Model chunks.
            optimizer: The optimizer.
            scheduler: The scheduler.
            flops_so_far: FLOPs so far (saved with the counters).
            non_persistent: A non-persistent (local) checkpoint.
        """
        timers = self.timers
        if timers is not None:
            timers("interval-time").stop()
        # Metrics up to this iteration reach disk before the checkpoint commits, so a crash
        # after the commit cannot lose the records of the steps the checkpoint holds.
        self.metric_writers.flush()
        if self.toggle_forward_pre_hooks:
            disable_forward_pre_hook(model)
        if timers is not None:
            timers("save-checkpoint", log_level=0).start(barrier=True)
        # The save call itself (synchronous part of an async save included) is an ordinary
        # checkpointing section; finalizing async saves later is its own section.
        with self.fault_tolerance.checkpointing():
            write_checkpoint(
                self.checkpoint,
                train_state,
                model,
                optimizer,
                scheduler,
                run_config=self.run_config,
                flops_so_far=flops_so_far,
                checkpointing_context=self.checkpointing_context,
                non_persistent=non_persistent,
                fault_tolerance=self.fault_tolerance,
            )
        if timers is not None:
            timers("save-checkpoint").stop(barrier=True)
            timers.log(["save-checkpoint"])
        if self.toggle_forward_pre_hooks:
            enable_forward_pre_hook(model)
        if not non_persistent and self.progress_log is not None:
            self.progress_log.saved_checkpoint(train_state, flops_so_far)
        if timers is not None:
            timers("interval-time", log_level=0).start(barrier=True)

    def __call__(self, context: LoopContext, non_persistent: bool) -> None:
        """The loop's save: the context's model, optimizer and scheduler at its iteration."""
        train_state: TrainProgress = context.train_state
        self.save(
            train_state,
            context.model,
            context.optimizer,
            context.scheduler,
            train_state.floating_point_operations_so_far,
            non_persistent=non_persistent,
        )
