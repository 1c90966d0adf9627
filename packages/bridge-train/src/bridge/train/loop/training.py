"""GPT-style training on the loop: the step, the save function and the run.

:func:`run_training` is the loop a reader needs: it builds the run's components
(:func:`bridge.train.loop.components.standard_components`: metrics, fault-tolerance
heartbeat, straggler report, weight-hash check, profiler, GC, evaluation, checkpointer), puts
the user's callbacks after them, and hands :func:`gpt_step_function`'s step to the
model-agnostic driver :func:`bridge.train.loop.run_loop.run_loop`. Every save decision lives
in the :class:`~bridge.train.loop.components.Checkpointer`; every log line in the
:class:`~bridge.train.loop.components.MetricsProcessor`. The reference's own functions
(``train``, ``train_step``, ...) are adapters over these in :mod:`bridge.train.api.train`;
``save_checkpoint_and_time`` is the reference's and the loop's save. ``run_training``
returns the process exit code (0 unless the rerun state machine asks for another).
Checkpoints are written by :mod:`bridge.train.checkpointing`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bridge.train.loop.batch_size import (
    ensure_num_microbatches_calculator,
    get_num_microbatches,
    release_num_microbatches_calculator,
    update_num_microbatches,
)
from bridge.train.loop.components import (
    loop_callback_list,
    standard_components,
)
from bridge.train.loop.components.checkpointer import finalize_async_checkpoints
from bridge.train.loop.eval import evaluate_and_print_results
from bridge.train.loop.forward_pre_hooks import (
    disable_forward_pre_hook,
    enable_forward_pre_hook,
    should_toggle_forward_pre_hook,
)
from bridge.train.loop.losses import reduce_losses, zero_grad_buffers
from bridge.train.loop.progress_log import compute_throughputs_and_append_to_progress_log
from bridge.train.loop.run_length import run_is_done
from bridge.train.loop.run_loop import LoopContext, StepFunction, StepResult, run_loop
from bridge.train.loop.state_injection import ForwardStepCallable, prepare_forward_step_func
from bridge.train.metrics.flops import num_floating_point_operations
from bridge.train.state import GlobalState
from core_utils.callbacks import Callback

__all__ = [
    "gpt_save_function",
    "gpt_step_function",
    "run_train_step",
    "run_training",
    "save_checkpoint_and_time",
]

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- helpers


def _parallel_state() -> Any:
    from megatron.core import parallel_state

    return parallel_state


def _data_parallel_size() -> int:
    ps = _parallel_state()
    return ps.get_data_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def _dp_cp_group() -> Any:
    ps = _parallel_state()
    if not ps.model_parallel_is_initialized():
        return None
    return ps.get_data_parallel_group(with_context_parallel=True)


def _is_last_pipeline_stage() -> bool:
    ps = _parallel_state()
    if not ps.model_parallel_is_initialized():
        return True
    return bool(ps.is_pipeline_last_stage(ignore_virtual=True))


def _handle_mxfp8_param_buffer_copy(
    optimizer: Any, reuse_grad_buf_for_mxfp8_param_ag: bool, overlap_param_gather: bool
) -> None:
    """Copy main params to param buffer for mxfp8 with grad buffer reuse.

    With mxfp8 parameters whose all-gather reuses the gradient buffer and an overlapped
    parameter gather, the parameter buffer must be refilled after the gradient buffer was
    zeroed (the two share memory). Only megatron's distributed optimizer has such buffers.
    """
    if reuse_grad_buf_for_mxfp8_param_ag and overlap_param_gather:
        copy = getattr(optimizer, "_copy_main_params_to_param_buffer", None)
        if copy is not None:
            copy()


# ----------------------------------------------------------------------------- the step


def run_train_step(
    forward_step_func: ForwardStepCallable,
    data_iterator: Any,
    model: list[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    global_state: GlobalState,
) -> StepResult:
    """One training iteration, as a :class:`~bridge.train.loop.run_loop.StepResult`.

    Zeroes the gradient buffers, runs the engine's forward-backward schedule over this
    iteration's micro-batches (megatron's rerun state machine may repeat it), steps the
    optimizer and, if the update was applied, the scheduler (by the global batch size in
    samples), and averages the reported losses over tokens of all micro-batches and
    data-parallel ranks. The averaged losses stay on the device (no host synchronisation).

    Args:
        forward_step_func: Function that performs a forward step (already wrapped if needed)
        data_iterator: Iterator over training data
        model: list of model chunks
        optimizer: Optimizer for model parameters
        scheduler: Learning rate scheduler
        global_state: Global training state

    Returns:
        The iteration's result (``train_state`` is not advanced here).
    """
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    cfg = global_state.cfg
    train = cfg.train
    assert train is not None and train.micro_batch_size is not None
    timers = global_state.timers
    rerun_state_machine = get_rerun_state_machine()
    forward_backward_func = global_state.forward_backward_func
    seq_length = int(getattr(cfg.model, "seq_length", 0) or 0)
    ddp = cfg.ddp
    num_microbatches = get_num_microbatches()

    losses_reduced: list[Any] = []
    while rerun_state_machine.should_run_forward_backward(data_iterator):
        zero_grad_buffers(model, optimizer)
        _handle_mxfp8_param_buffer_copy(
            optimizer,
            bool(getattr(ddp, "reuse_grad_buf_for_mxfp8_param_ag", False)),
            bool(getattr(ddp, "overlap_param_gather", False)),
        )
        losses_reduced = forward_backward_func(
            forward_step_func=forward_step_func,
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
            skipped=True, should_checkpoint=should_checkpoint, should_exit=True, exit_code=exit_code
        )

    if train.empty_unused_memory_level >= 1 and torch.cuda.is_available():
        torch.cuda.empty_cache()

    timers("optimizer", log_level=1).start(barrier=False)
    update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
    timers("optimizer").stop()

    batch_size = num_microbatches * train.micro_batch_size * _data_parallel_size()
    if update_successful:
        scheduler.step(increment=batch_size)

    if train.empty_unused_memory_level >= 2 and torch.cuda.is_available():
        torch.cuda.empty_cache()

    losses = reduce_losses(losses_reduced, _dp_cp_group()) if _is_last_pipeline_stage() else {}
    return StepResult(
        losses=losses,
        skipped=not update_successful,
        grad_norm=grad_norm,
        num_zeros_in_grad=num_zeros_in_grad,
        should_checkpoint=should_checkpoint,
        num_samples=batch_size,
        flops=num_floating_point_operations(cfg.model, batch_size),
    )


def gpt_step_function(forward_step_func: ForwardStepCallable, state: GlobalState) -> StepFunction:
    """The loop's step for megatron-style models: :func:`run_train_step` on the context.

    The number of micro-batches follows the batch-size ramp-up; with nvidia-resiliency-ext
    straggler detection the step is timed by its monitor.

    Args:
        forward_step_func: ``(data_iterator, model)`` or ``(state, data_iterator, model)``.
        state: The run's global state (injected into the forward step when it asks).

    Returns:
        A :data:`~bridge.train.loop.run_loop.StepFunction`.
    """
    step_func = prepare_forward_step_func(forward_step_func, state)
    nvrx = state.nvrx_straggler
    run = nvrx.wrap(run_train_step) if nvrx is not None else run_train_step

    def step(context: LoopContext) -> StepResult:
        update_num_microbatches(context.train_state.consumed_train_samples)
        result: StepResult = run(
            step_func,
            context.train_data_iterator,
            context.model,
            context.optimizer,
            context.scheduler,
            state,
        )
        return result

    return step


# ----------------------------------------------------------------------------- checkpoints


def save_checkpoint_and_time(
    state: GlobalState,
    model: list[torch.nn.Module],
    optimizer: Any,
    opt_param_scheduler: Any,
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
    ``progress.txt``.

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
    from bridge.train.checkpointing import save_checkpoint

    cfg = state.cfg
    timers = state.timers
    timers("interval-time").stop()
    # Metrics up to this iteration reach disk before the checkpoint commits, so a crash
    # after the commit cannot lose the records of the steps the checkpoint holds.
    state.metric_writers.flush()
    toggle = should_toggle_forward_pre_hook(cfg)
    if toggle:
        disable_forward_pre_hook(model)
    timers("save-checkpoint", log_level=0).start(barrier=True)
    # The save call itself (synchronous part of an async save included) is an ordinary
    # checkpointing section; finalizing async saves later is its own section.
    with state.fault_tolerance.checkpointing():
        save_checkpoint(
            state,
            model,
            optimizer,
            opt_param_scheduler,
            num_floating_point_operations_so_far,
            checkpointing_context=checkpointing_context,
            non_persistent_ckpt=non_persistent_ckpt,
            train_data_iterator=train_data_iterator,
        )
    timers("save-checkpoint").stop(barrier=True)
    timers.log(["save-checkpoint"])
    if toggle:
        enable_forward_pre_hook(model)
    if not non_persistent_ckpt:
        state.last_saved_iteration = state.train_state.step
    if not non_persistent_ckpt and cfg.logger is not None and cfg.logger.log_progress:
        compute_throughputs_and_append_to_progress_log(state, num_floating_point_operations_so_far)
    timers("interval-time", log_level=0).start(barrier=True)


def gpt_save_function(checkpointing_context: dict[str, Any]) -> Any:
    """The :data:`~bridge.train.loop.components.SaveFunction` of GPT-style training:
    :func:`save_checkpoint_and_time` with the run's FLOPs so far."""

    def save(context: LoopContext, non_persistent: bool) -> None:
        state = context.state
        save_checkpoint_and_time(
            state,
            context.model,
            context.optimizer,
            context.scheduler,
            state.train_state.floating_point_operations_so_far,
            checkpointing_context,
            non_persistent_ckpt=non_persistent,
            train_data_iterator=context.train_data_iterator,
        )

    return save


def _finish_train(global_state: GlobalState) -> None:
    """End of training: finish pending checkpoint saves, then stop the resiliency machinery.

    Waits for asynchronous saves, shuts fault tolerance down (clean: computed timeouts are
    stored), stops straggler detection, restores the exit-signal handler (after the last
    save) and flushes the metric writers. Idempotent. Collective.
    """
    cfg = global_state.cfg
    if cfg.checkpoint is not None and cfg.checkpoint.save is not None:
        from bridge.train.checkpointing import finalize_async_saves

        finalize_async_saves(global_state, blocking=True, terminate=True)
    global_state.fault_tolerance.shutdown(clean=True)
    if global_state.nvrx_straggler is not None:
        global_state.nvrx_straggler.shutdown()
    global_state.straggler_timing.close()
    if global_state.exit_conditions is not None:
        global_state.exit_conditions.close()
    global_state.metric_writers.flush()


# ----------------------------------------------------------------------------- the loop


def run_training(
    forward_step_func: ForwardStepCallable,
    model: list[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    train_data_iterator: Any,
    valid_data_iterator: Any,
    global_state: GlobalState,
    checkpointing_context: dict[str, Any],
    process_non_loss_data_func: Callable[..., Any] | None = None,
    non_loss_data_func: Callable[..., Any] | None = None,
    *,
    callbacks: Sequence[Callback] = (),
    tokenizer: Any = None,
) -> int:
    """:func:`train` with user callbacks (what :func:`bridge.train.pretrain` calls).

    Args:
        forward_step_func: See :func:`train`.
        model: See :func:`train`.
        optimizer: See :func:`train`.
        scheduler: See :func:`train`.
        train_data_iterator: See :func:`train`.
        valid_data_iterator: See :func:`train`.
        global_state: See :func:`train`.
        checkpointing_context: See :func:`train`.
        process_non_loss_data_func: See :func:`train`.
        non_loss_data_func: See :func:`train`.
        callbacks: User callbacks (:class:`bridge.train.Callback`), run after the loop's
            components and after the config's ``callbacks``.
        tokenizer: The run's tokenizer (the ``samples`` section generates with it).

    Returns:
        The process exit code (see :func:`train`).

    Raises:
        core_utils.CallbackError: A user callback raised (names callback, hook, iteration).
    """
    state, cfg = global_state, global_state.cfg
    assert cfg.train is not None and cfg.logger is not None, "train and logger sections required"
    owns_calculator = ensure_num_microbatches_calculator(cfg.train, _data_parallel_size())
    for chunk in model:
        chunk.train()
    toggle_hooks = should_toggle_forward_pre_hook(cfg)

    def evaluate(context: LoopContext) -> None:
        # Evaluation must see whole parameters, not ones a pending overlapped all-gather
        # would still overwrite.
        if toggle_hooks:
            disable_forward_pre_hook(model)
        evaluate_and_print_results(
            state,
            f"iteration {context.iteration}",
            forward_step_func,
            valid_data_iterator,
            model,
            cfg,
            verbose=False,
            write_to_tensorboard=True,
            process_non_loss_data_func=process_non_loss_data_func,
            non_loss_data_func=non_loss_data_func,
        )
        if toggle_hooks:
            enable_forward_pre_hook(model)

    async_saves = bool(cfg.checkpoint and cfg.checkpoint.save and cfg.checkpoint.async_save)
    components = standard_components(
        state,
        save=gpt_save_function(checkpointing_context),
        finalize=finalize_async_checkpoints if async_saves else None,
        evaluate=evaluate,
        toggle_forward_pre_hooks=toggle_hooks,
        tokenizer=tokenizer,
    )
    context = LoopContext(
        state,
        model,
        optimizer,
        scheduler,
        train_data_iterator,
        valid_data_iterator,
        callbacks=loop_callback_list(components, [*cfg.callbacks, *callbacks]),
    )
    state.timers("interval-time", log_level=0).start(barrier=True)
    try:
        exit_code = run_loop(
            context,
            gpt_step_function(forward_step_func, state),
            is_done=lambda c: run_is_done(cfg.train, c.train_state),
        )
        state.timers("interval-time").stop()
        _finish_train(state)
    finally:
        for component in components:
            close = getattr(component, "close", None)
            if close is not None:
                close()
        if owns_calculator:
            release_num_microbatches_calculator()
    return exit_code
