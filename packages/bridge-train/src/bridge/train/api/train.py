"""The reference's loop functions (shared/reference 001: signatures and behaviour), as thin
adapters over the loop's parts, which :class:`bridge.train.loop.training.RunComponents`
builds from the ``GlobalState`` or the whole config they take; the loop itself never calls
them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from bridge.config import ConfigContainer
from bridge.train.loop.components import Checkpointer
from bridge.train.loop.components.maintenance import (
    check_weight_hash,
    collect_garbage,
    synchronize_device,
)
from bridge.train.loop.components.profiler import step_profiler
from bridge.train.loop.profiling import TNvtxContext
from bridge.train.loop.training import RunComponents, run_training
from bridge.train.state import ForwardStepCallable, GlobalState
from core_utils.loop import LoopContext

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

__all__ = [
    "checkpoint_and_decide_exit",
    "post_training_step_callbacks",
    "save_checkpoint_and_time",
    "train",
    "train_step",
]


def train(
    forward_step_func: ForwardStepCallable,
    model: list[torch.nn.Module],
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    train_data_iterator: Any,
    valid_data_iterator: Any,
    global_state: GlobalState,
    checkpointing_context: dict[str, Any],
    process_non_loss_data_func: Callable[..., Any] | None = None,
    non_loss_data_func: Callable[..., Any] | None = None,
) -> int:
    """Main training loop.

    Handles the overall training process, including the iteration loop, calling train_step,
    evaluation, checkpointing, logging, and exit conditions. Trains until ``train.train_iters``
    iterations (or ``train.train_samples`` samples) are done or an exit condition holds;
    saves a final checkpoint when ``checkpoint.save`` is set and the last iteration was not
    saved. Every rank must call it.

    Args:
        forward_step_func: Callable that executes a single forward step.
        model: list of model chunks (potentially wrapped in DDP).
        optimizer: The optimizer instance.
        scheduler: The learning rate scheduler instance.
        train_data_iterator: Iterator for the training dataset.
        valid_data_iterator: Iterator for the validation dataset.
        global_state: The GlobalState object holding various training states.
        checkpointing_context: Context dictionary for checkpointing.
        process_non_loss_data_func: Optional function to process non-loss data during
            evaluation.
        non_loss_data_func: Optional function to compute non-loss data during evaluation.

    Returns:
        The exit code for the process: 0, or the rerun state machine's code when it stops
        the job.

    Raises:
        core_utils.CallbackError: A user callback raised (names callback, hook, iteration).

    .. warning::
        This is an experimental API and is subject to change in backwards incompatible
        ways without notice.
    """
    components = RunComponents(
        global_state,
        forward_step_func,
        checkpointing_context,
        process_non_loss_data_func,
        non_loss_data_func,
    )
    return run_training(
        components, model, optimizer, scheduler, train_data_iterator, valid_data_iterator
    )


def train_step(
    forward_step_func: ForwardStepCallable,
    data_iterator: Any,
    model: list[torch.nn.Module],
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    global_state: GlobalState,
) -> tuple[dict[str, torch.Tensor], int, bool, bool, int, float | None, int | None]:
    """Single training step.

    The reference's form of :meth:`~bridge.train.loop.step.TrainStep.run` (which the
    loop calls): the same work, its result as a tuple.

    Args:
        forward_step_func: Function that performs a forward step (already wrapped if needed)
        data_iterator: Iterator over training data
        model: list of model chunks
        optimizer: Optimizer for model parameters
        scheduler: Learning rate scheduler
        global_state: Global training state

    Returns:
        tuple containing
            loss_dict: Dictionary of reduced losses (empty except on the last pipeline stage)
            skipped_iter: Whether the iteration was skipped (1) or not (0)
            should_checkpoint: Whether a checkpoint should be saved
            should_exit: Whether training should exit
            exit_code: Exit code if should_exit is True
            grad_norm: Gradient norm if available, None otherwise
            num_zeros_in_grad: Number of zeros in gradient if available, None otherwise
    """
    step = RunComponents(global_state, forward_step_func).step
    return step.run(data_iterator, model, optimizer, scheduler).as_tuple()


def post_training_step_callbacks(
    model: list[torch.nn.Module],
    num_floating_point_operations_since_last_log_event: float,
    straggler_timer: Any,
    iteration: int,
    prof: torch.profiler.profile | None,
    config: ConfigContainer,
    should_toggle_forward_pre_hook: bool,
    nsys_nvtx_context: TNvtxContext | None = None,
    *,
    fault_tolerance: Any = None,
) -> None:
    """Run all post-training-step functions (e.g., FT heartbeats, GC).

    In order: the fault-tolerance end-of-step heartbeat, CPU/GPU sync every
    ``train.train_sync_interval``, the straggler report every ``logger.log_interval``, the
    weight-hash check across data-parallel replicas every
    ``train.check_weight_hash_across_dp_replicas_interval`` (forward pre-hooks toggled
    around it when needed), the profiler step (and stop at ``profiling.profile_step_end``),
    and manual garbage collection every ``train.manual_gc_interval``. Collective wherever
    the features it runs are (every rank must call it after every step). The loop itself
    runs the same functions through its components.

    Args:
        model: list of model chunks wrapped in DDP
        num_floating_point_operations_since_last_log_event: Number of floating point
            operations since last log
        straggler_timer: Timer for straggler detection (a ``bridge.resiliency.StragglerTiming``)
        iteration: Current training iteration
        prof: PyTorch profiler instance
        config: Configuration container
        should_toggle_forward_pre_hook: Whether to toggle forward pre-hook
        nsys_nvtx_context: NVTX context for nsys profiling (if active)
        fault_tolerance: Fault-tolerance hooks whose ``on_step_end`` heartbeat ends the step.

    Raises:
        WeightHashMismatchError: The weights differ across data-parallel replicas.
    """
    train, logger_cfg = config.train, config.logger
    assert train is not None and logger_cfg is not None
    if fault_tolerance is not None:
        fault_tolerance.on_step_end()
    synchronize_device(train.train_sync_interval, iteration)
    if straggler_timer is not None:
        straggler_timer.maybe_report(
            iteration,
            num_floating_point_operations_since_last_log_event,
            logger_cfg.log_interval,
        )
    check_weight_hash(
        model,
        train.check_weight_hash_across_dp_replicas_interval,
        iteration,
        should_toggle_forward_pre_hook,
    )
    step_profiler(prof, nsys_nvtx_context, iteration, config.profiling)
    collect_garbage(train.manual_gc, train.manual_gc_interval, iteration)


def save_checkpoint_and_time(
    state: GlobalState,
    model: list[torch.nn.Module],
    optimizer: MegatronOptimizer,
    opt_param_scheduler: OptimizerParamScheduler,
    num_floating_point_operations_so_far: float,
    checkpointing_context: dict[str, Any],
    non_persistent_ckpt: bool = False,
    train_data_iterator: Any = None,
) -> None:
    """Saves a checkpoint and logs the timing.

    Wraps the ``save_checkpoint`` function with timers and potentially disables/ enables
    forward pre-hooks if distributed optimizer with overlapped parameter gather is used. The
    save is a fault-tolerance checkpointing section; ``interval-time`` is paused so the save
    does not count as iteration time. The metric writers are flushed before the save; after
    a persistent save with ``logger.log_progress`` the throughputs are appended to
    ``progress.txt``. The loop's own saves are the same
    :class:`~bridge.train.loop.saving.CheckpointWriter`.

    Args:
        state: The global state object.
        model: list of model chunks (MegatronModule instances).
        optimizer: The optimizer instance.
        opt_param_scheduler: The optimizer parameter scheduler instance.
        num_floating_point_operations_so_far: Cumulative TFLOPs up to this point.
        checkpointing_context: Dictionary holding checkpointing-related state.
        non_persistent_ckpt: Flag indicating if this is a non-persistent (local) checkpoint.
            Defaults to False.
        train_data_iterator: Optional training data iterator to save its state.
    """
    del train_data_iterator  # the samplers resume from the consumed-samples counter
    writer = RunComponents(state, checkpointing_context=checkpointing_context).checkpoint_writer
    assert writer is not None, "save_checkpoint_and_time needs the checkpoint section"
    writer.save(
        state.train_state,
        model,
        optimizer,
        opt_param_scheduler,
        num_floating_point_operations_so_far,
        non_persistent=non_persistent_ckpt,
    )
    if not non_persistent_ckpt:
        state.last_saved_iteration = state.train_state.step


def checkpoint_and_decide_exit(
    state: GlobalState,
    model: list[torch.nn.Module],
    optimizer: MegatronOptimizer,
    opt_param_scheduler: OptimizerParamScheduler,
    num_floating_point_operations_so_far: float,
    checkpointing_context: dict[str, Any],
    train_data_iterator: Any,
) -> bool:
    """Handles checkpointing decisions and determines if training should exit.

    Checks various conditions for saving a checkpoint (signal received, interval, duration)
    and determines if the training loop should terminate based on exit conditions (signal,
    duration, iteration interval). A persistent checkpoint is saved every
    ``checkpoint.save_interval`` iterations and a non-persistent one every
    ``checkpoint.non_persistent_save_interval``; an early exit saves exactly one checkpoint
    (none if this iteration was just saved). Collective: every rank agrees on the decision
    (:meth:`bridge.resiliency.ExitConditions.check`). The loop makes the same decisions in
    its :class:`~bridge.train.loop.components.Checkpointer`, which this calls.

    Args:
        state: The global state object.
        model: list of model chunks (MegatronModule instances).
        optimizer: The optimizer instance.
        opt_param_scheduler: The optimizer parameter scheduler instance.
        num_floating_point_operations_so_far: Cumulative TFLOPs up to this point.
        checkpointing_context: Dictionary holding checkpointing-related state.
        train_data_iterator: Optional training data iterator to save its state.

    Returns:
        True if the training loop should exit, False otherwise.
    """

    def save(context: LoopContext, non_persistent: bool) -> None:
        save_checkpoint_and_time(
            state,
            model,
            optimizer,
            opt_param_scheduler,
            num_floating_point_operations_so_far,
            checkpointing_context,
            non_persistent_ckpt=non_persistent,
            train_data_iterator=train_data_iterator,
        )

    context = LoopContext(
        state.train_state, model, optimizer, opt_param_scheduler, train_data_iterator, state=state
    )
    checkpointer = Checkpointer(save, state.cfg.checkpoint, exit_conditions=state.exit_conditions)
    decision = checkpointer.save_and_decide(context)  # a save records last_saved_iteration
    return decision is not None and decision.should_exit
