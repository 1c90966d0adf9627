"""The step of megatron-style training: one iteration through the engine's schedule.

:class:`TrainStep` is the loop's step function for GPT, T5 and Mamba models: built from the
``train``, ``model`` and ``ddp`` sections, the engine's forward-backward schedule, the
forward step and the timers; it returns a :class:`core_utils.loop.StepResult` and leaves the
counters to the loop. The reference's ``train_step`` is its adapter
(:mod:`bridge.train.api.train`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from megatron.core import parallel_state
from megatron.core.num_microbatches_calculator import (
    get_num_microbatches,
    update_num_microbatches,
)
from megatron.core.rerun_state_machine import get_rerun_state_machine

from bridge.config import DDPConfigProtocol, TrainingConfig
from bridge.resiliency import NVRxStragglerMonitor
from bridge.train.loop.losses import reduce_losses, zero_grad_buffers
from bridge.train.metrics.flops import num_floating_point_operations
from bridge.train.state import ForwardStepCallable
from core_utils import Timers
from core_utils.loop import LoopContext, StepResult

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

__all__ = ["TrainStep", "data_parallel_layout", "data_parallel_size"]


def data_parallel_size() -> int:
    """The data-parallel size of megatron's parallel state (1 before it exists)."""
    return data_parallel_layout()[0]


def data_parallel_layout() -> tuple[int, Any, bool]:
    """``(data-parallel size, data+context-parallel group, last pipeline stage)`` of
    megatron's parallel state (``(1, None, True)`` before it exists): where the step's and
    the evaluation's losses are reduced."""
    if not parallel_state.model_parallel_is_initialized():
        return 1, None, True
    return (
        parallel_state.get_data_parallel_world_size(),
        parallel_state.get_data_parallel_group(with_context_parallel=True),
        bool(parallel_state.is_pipeline_last_stage(ignore_virtual=True)),
    )


@dataclass
class TrainStep:
    """One megatron-style training iteration: the loop's step function for GPT, T5 and
    Mamba models (any model the engine's forward-backward schedule runs).

    Zeroes the gradient buffers, runs the engine's forward-backward schedule over this
    iteration's micro-batches (megatron's rerun state machine may repeat it), steps the
    optimizer and, if the update was applied, the scheduler (by the global batch size in
    samples), and averages the reported losses over tokens of all micro-batches and
    data-parallel ranks. The averaged losses stay on the device (no host synchronisation).
    As the loop's step, it first advances the micro-batch calculator (batch-size ramp-up);
    with nvidia-resiliency-ext straggler detection the iteration is timed by its monitor.

    Attributes:
        forward_step_func: The forward step, state already injected if it asks for it
            (:func:`~bridge.train.loop.state_injection.prepare_forward_step_func`).
        forward_backward_func: The engine's schedule.
        train: The ``train`` section (``micro_batch_size``, ``empty_unused_memory_level``).
        model_config: The model config (``seq_length``; FLOPs per sample).
        ddp_config: The ``ddp`` section (mxfp8 parameter-buffer reuse), if any.
        timers: The run's timers (``optimizer`` is timed).
        nvrx_straggler: The NVRx straggler monitor that times the step, if any.
    """

    forward_step_func: ForwardStepCallable
    forward_backward_func: Callable[..., list[Any]]
    train: TrainingConfig
    model_config: Any
    ddp_config: DDPConfigProtocol | None = None
    timers: Timers = field(default_factory=lambda: Timers(0, "minmax"))
    nvrx_straggler: NVRxStragglerMonitor | None = None

    def __post_init__(self) -> None:
        self._timed_run: Callable[..., StepResult] | None = None

    def run(
        self,
        data_iterator: Any,
        model: list[torch.nn.Module],
        optimizer: MegatronOptimizer,
        scheduler: OptimizerParamScheduler,
    ) -> StepResult:
        """One iteration on ``data_iterator`` (``train_state`` is not advanced here).

        Args:
            data_iterator: Iterator over training data.
            model: Model chunks.
            optimizer: Optimizer for model parameters.
            scheduler: Learning-rate scheduler.

        Returns:
            The iteration's result.
        """
        train = self.train
        assert train.micro_batch_size is not None
        timers = self.timers
        rerun_state_machine = get_rerun_state_machine()
        seq_length = int(getattr(self.model_config, "seq_length", 0) or 0)
        ddp = self.ddp_config
        num_microbatches = get_num_microbatches()
        # mxfp8 parameters whose all-gather reuses the gradient buffer, gathered overlapped:
        # the parameter buffer shares memory with the gradient buffer just zeroed and is
        # refilled from the main params (only megatron's distributed optimizer has one).
        copy_param_buffer = None
        if getattr(ddp, "reuse_grad_buf_for_mxfp8_param_ag", False) and getattr(
            ddp, "overlap_param_gather", False
        ):
            copy_param_buffer = getattr(optimizer, "_copy_main_params_to_param_buffer", None)

        losses_reduced: list[Any] = []
        while rerun_state_machine.should_run_forward_backward(data_iterator):
            zero_grad_buffers(model, optimizer)
            if copy_param_buffer is not None:
                copy_param_buffer()
            losses_reduced = self.forward_backward_func(
                forward_step_func=self.forward_step_func,
                data_iterator=data_iterator,
                model=model,
                num_microbatches=num_microbatches,
                seq_length=seq_length,
                micro_batch_size=train.micro_batch_size,
                decoder_seq_length=seq_length,
                forward_only=False,
            )
        should_checkpoint, should_exit, exit_code = rerun_state_machine.should_checkpoint_and_exit()
        if should_exit:
            return StepResult(
                skipped=True,
                should_checkpoint=should_checkpoint,
                should_exit=True,
                exit_code=exit_code,
            )

        if train.empty_unused_memory_level >= 1 and torch.cuda.is_available():
            torch.cuda.empty_cache()

        timers("optimizer", log_level=1).start(barrier=False)
        update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
        timers("optimizer").stop()

        dp_size, dp_cp_group, last_stage = data_parallel_layout()
        batch_size = num_microbatches * train.micro_batch_size * dp_size
        if update_successful:
            scheduler.step(increment=batch_size)

        if train.empty_unused_memory_level >= 2 and torch.cuda.is_available():
            torch.cuda.empty_cache()

        losses = reduce_losses(losses_reduced, dp_cp_group) if last_stage else {}
        return StepResult(
            losses=losses,
            skipped=not update_successful,
            grad_norm=grad_norm,
            num_zeros_in_grad=num_zeros_in_grad,
            should_checkpoint=should_checkpoint,
            num_samples=batch_size,
            flops=num_floating_point_operations(self.model_config, batch_size),
        )

    def __call__(self, context: LoopContext) -> StepResult:
        """The loop's step: the micro-batch count follows the ramp-up, then :meth:`run`."""
        update_num_microbatches(context.train_state.consumed_train_samples, consistency_check=True)
        if self._timed_run is None:  # wrapped once, for the loop only
            nvrx = self.nvrx_straggler
            self._timed_run = nvrx.wrap(self.run) if nvrx is not None else self.run
        return self._timed_run(
            context.train_data_iterator, context.model, context.optimizer, context.scheduler
        )
