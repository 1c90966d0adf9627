"""The training loop: :func:`train` runs :func:`train_step` per iteration, logs, evaluates,
saves and decides when to stop.

Shape of :func:`train` (every rank runs it; the engine underneath does not matter)::

    set up: forward-step state injection, micro-batch calculator, manual GC, timers
    while the run is not done:
        profiler start (at profiling.profile_step_start)
        train_step                         (fault-tolerance step section around it)
        advance train_state (step, samples, FLOPs); training_log
        post_training_step_callbacks       (straggler report, weight hashes, profiler, GC)
        evaluate every train.eval_interval
        checkpoint_and_decide_exit         (save interval, exit signal/duration/interval)
    final checkpoint (when the last iteration was not saved); _finish_train

``train()`` returns the process exit code (0 unless the rerun state machine asks for
another). Checkpoints are written by :mod:`bridge.train.checkpointing`.
"""

from __future__ import annotations

import collections
import gc
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from bridge.logging import ProgressReporter, training_log
from bridge.train.bare_loop import reduce_loss_dicts
from bridge.train.flops import num_floating_point_operations
from bridge.train.norms import calc_params_l2_norm
from bridge.train.state import GlobalState
from bridge.train.state_injection import ForwardStepCallable, prepare_forward_step_func
from bridge.train.training.batch_size import (
    ensure_num_microbatches_calculator,
    get_num_microbatches,
    release_num_microbatches_calculator,
    update_num_microbatches,
)
from bridge.train.training.eval import evaluate_and_print_results
from bridge.train.training.profiling import (
    TNvtxContext,
    should_profile_rank,
    start_profiler,
    stop_profiler,
)
from bridge.train.training.progress_log import compute_throughputs_and_append_to_progress_log

__all__ = [
    "WeightHashMismatchError",
    "checkpoint_and_decide_exit",
    "disable_forward_pre_hook",
    "enable_forward_pre_hook",
    "post_training_step_callbacks",
    "save_checkpoint_and_time",
    "should_disable_forward_pre_hook",
    "train",
    "train_step",
]

logger = logging.getLogger(__name__)


class WeightHashMismatchError(RuntimeError):
    """Data-parallel replicas hold different weights (``check_weight_hash_...``)."""


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


def _model_config(model: list[torch.nn.Module]) -> Any:
    from megatron.core.utils import get_model_config

    return get_model_config(model[0])


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _learning_rates(optimizer: Any) -> tuple[float | None, float | None]:
    """``(learning rate, decoupled learning rate)`` of the optimizer's parameter groups."""
    learning_rate: float | None = None
    decoupled: float | None = None
    for group in optimizer.param_groups:
        if len(group["params"]) == 0:
            continue
        if group.get("is_decoupled_lr", False):
            decoupled = float(group["lr"])
        else:
            learning_rate = float(group["lr"])
    return learning_rate, decoupled


def _run_is_done(cfg: Any, train_state: Any) -> bool:
    train = cfg.train
    if train.train_samples is not None:
        return train_state.consumed_train_samples >= train.train_samples
    return train_state.step >= (train.train_iters or 0)


def _total_iterations(cfg: Any) -> int | None:
    """Iterations of the whole run (estimated for sample-based runs with ramp-up)."""
    train = cfg.train
    if train.train_iters is not None:
        return int(train.train_iters)
    if train.train_samples is not None and train.global_batch_size:
        return -(-int(train.train_samples) // int(train.global_batch_size))
    return None


# ----------------------------------------------------------------------------- hooks


def should_disable_forward_pre_hook(
    use_megatron_fsdp: bool, use_distributed_optimizer: bool, overlap_param_gather: bool
) -> bool:
    """Determine if forward pre-hooks should be disabled during checkpointing.

    Forward pre-hooks need to be disabled during checkpoint saving when using distributed
    optimizer with overlapped parameter gathering (megatron DDP gathers a bucket's parameters
    in the hook of the next forward; a save in between must see complete parameters).

    Args:
        use_megatron_fsdp: Whether Megatron FSDP is enabled.
        use_distributed_optimizer: Whether distributed optimizer is enabled.
        overlap_param_gather: Whether parameter gathering is overlapped.

    Returns:
        True if forward pre-hooks should be disabled, False otherwise.
    """
    return bool(not use_megatron_fsdp and use_distributed_optimizer and overlap_param_gather)


def enable_forward_pre_hook(model: list[Any]) -> None:
    """Enable forward pre-hook for all model chunks.

    Chunks without forward pre-hooks (the portable engine's data-parallel wrapper, plain
    modules) are left as they are.

    Args:
        model: list of model chunks wrapped in DDP
    """
    for chunk in model:
        enable = getattr(chunk, "enable_forward_pre_hook", None)
        if enable is not None:
            enable()


def disable_forward_pre_hook(model: list[Any], param_sync: bool = True) -> None:
    """Disable forward pre-hook for all model chunks.

    Chunks without forward pre-hooks (the portable engine's data-parallel wrapper, plain
    modules) are left as they are.

    Args:
        model: list of model chunks wrapped in DDP
        param_sync: Whether to synchronize parameters across model chunks (finish the
            pending overlapped parameter all-gather first)
    """
    for chunk in model:
        disable = getattr(chunk, "disable_forward_pre_hook", None)
        if disable is not None:
            disable(param_sync=param_sync)


def _should_toggle_forward_pre_hook(cfg: Any) -> bool:
    ddp = cfg.ddp
    return should_disable_forward_pre_hook(
        bool(getattr(ddp, "use_megatron_fsdp", False)),
        bool(getattr(cfg.optimizer, "use_distributed_optimizer", False)),
        bool(getattr(ddp, "overlap_param_gather", False)),
    )


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


def train_step(
    forward_step_func: ForwardStepCallable,
    data_iterator: Any,
    model: list[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    global_state: GlobalState,
) -> tuple[dict[str, torch.Tensor], int, bool, bool, int, float | None, int | None]:
    """Single training step.

    Zeroes the gradient buffers, runs the engine's forward-backward schedule over this
    iteration's micro-batches (megatron's rerun state machine may repeat it), steps the
    optimizer and, if the update was applied, the scheduler (by the global batch size in
    samples), and averages the reported losses over tokens of all micro-batches and
    data-parallel ranks.

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
        for chunk in model:
            zero_grad_buffer = getattr(chunk, "zero_grad_buffer", None)
            if zero_grad_buffer is not None:
                zero_grad_buffer()
        optimizer.zero_grad()
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
        return {}, 1, should_checkpoint, should_exit, exit_code, None, None

    if train.empty_unused_memory_level >= 1 and torch.cuda.is_available():
        torch.cuda.empty_cache()

    timers("optimizer", log_level=1).start(barrier=False)
    update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
    timers("optimizer").stop()

    if update_successful:
        increment = num_microbatches * train.micro_batch_size * _data_parallel_size()
        scheduler.step(increment=increment)
        skipped_iter = 0
    else:
        skipped_iter = 1

    if train.empty_unused_memory_level >= 2 and torch.cuda.is_available():
        torch.cuda.empty_cache()

    loss_dict: dict[str, torch.Tensor] = {}
    if _is_last_pipeline_stage():
        for name, (value_sum, count) in reduce_loss_dicts(losses_reduced, _dp_cp_group()).items():
            loss_dict[name] = torch.tensor(value_sum / max(count, 1.0), dtype=torch.float64)
    return (
        loss_dict,
        skipped_iter,
        should_checkpoint,
        should_exit,
        exit_code,
        None if grad_norm is None else float(grad_norm),
        None if num_zeros_in_grad is None else int(num_zeros_in_grad),
    )


def post_training_step_callbacks(
    model: list[torch.nn.Module],
    num_floating_point_operations_since_last_log_event: float,
    straggler_timer: Any,
    iteration: int,
    prof: torch.profiler.profile | None,
    config: Any,
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
    the features it runs are (every rank must call it after every step).

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
    train = config.train
    if fault_tolerance is not None:
        fault_tolerance.on_step_end()
    if (
        train.train_sync_interval
        and iteration % train.train_sync_interval == 0
        and torch.cuda.is_available()
    ):
        torch.cuda.synchronize()
    if straggler_timer is not None:
        straggler_timer.maybe_report(
            iteration,
            num_floating_point_operations_since_last_log_event,
            config.logger.log_interval,
        )
    interval = train.check_weight_hash_across_dp_replicas_interval
    if interval and iteration % interval == 0:
        from core_utils import check_param_hashes_across_dp_replicas

        if should_toggle_forward_pre_hook:
            disable_forward_pre_hook(model)
        matching = check_param_hashes_across_dp_replicas(model, cross_check=True)
        if should_toggle_forward_pre_hook:
            enable_forward_pre_hook(model)
        if not matching:
            raise WeightHashMismatchError(
                f"iteration {iteration}: the model weights differ across data-parallel "
                "replicas (the differing parameters are logged above); training stopped. "
                "Check for non-deterministic updates or a faulty rank, and resume from the "
                "last checkpoint (train.check_weight_hash_across_dp_replicas_interval)"
            )
    profiling = config.profiling
    if profiling is not None and (prof is not None or nsys_nvtx_context is not None):
        if prof is not None:
            prof.step()
        if iteration >= profiling.profile_step_end:
            stop_profiler(prof, nsys_nvtx_context)
    if train.manual_gc and train.manual_gc_interval and iteration % train.manual_gc_interval == 0:
        gc.collect()


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
    toggle = _should_toggle_forward_pre_hook(cfg)
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


def checkpoint_and_decide_exit(
    state: GlobalState,
    model: list[torch.nn.Module],
    optimizer: Any,
    opt_param_scheduler: Any,
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
    (:meth:`bridge.resiliency.ExitConditions.check`).

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
    cfg = state.cfg
    checkpoint = cfg.checkpoint
    iteration = state.train_state.step
    saved = False
    save_enabled = checkpoint is not None and checkpoint.save is not None
    args = (
        state,
        model,
        optimizer,
        opt_param_scheduler,
        num_floating_point_operations_so_far,
        checkpointing_context,
    )
    if (
        save_enabled
        and checkpoint is not None
        and checkpoint.save_interval
        and iteration % checkpoint.save_interval == 0
    ):
        save_checkpoint_and_time(*args, train_data_iterator=train_data_iterator)
        saved = True
    elif (
        checkpoint is not None
        and checkpoint.non_persistent_save_interval
        and iteration % checkpoint.non_persistent_save_interval == 0
    ):
        save_checkpoint_and_time(
            *args, non_persistent_ckpt=True, train_data_iterator=train_data_iterator
        )
        saved = True
    exits = state.exit_conditions
    if exits is None:
        return False
    decision = exits.check(iteration, saved_this_iteration=saved)
    if decision.should_save and save_enabled:
        save_checkpoint_and_time(*args, train_data_iterator=train_data_iterator)
    if decision.should_exit:
        if _rank() == 0:
            print(f"[bridge-train] {decision.message}", flush=True)
        return True
    return False


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


def train(
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

    .. warning::
        This is an experimental API and is subject to change in backwards incompatible
        ways without notice.
    """
    state = global_state
    cfg = state.cfg
    train_cfg = cfg.train
    logger_cfg = cfg.logger
    assert train_cfg is not None and logger_cfg is not None, "train and logger sections required"
    timers = state.timers
    train_state = state.train_state
    micro_batch_size = int(train_cfg.micro_batch_size or 1)
    dp_size = _data_parallel_size()
    owns_calculator = ensure_num_microbatches_calculator(train_cfg, dp_size)
    step_func = prepare_forward_step_func(forward_step_func, state)
    for chunk in model:
        chunk.train()

    toggle_hooks = _should_toggle_forward_pre_hook(cfg)
    gc_was_enabled = gc.isenabled()
    if train_cfg.manual_gc:
        # Collect at fixed points on every rank instead of whenever allocation counts say.
        gc.disable()
        gc.collect()

    # Timestamps for the rolling throughput window (bridge.logging reads at most window + 1).
    window = max(
        state.metric_writers.report_settings.throughput_window_size or 0,
        getattr(logger_cfg, "throughput_window_size", None) or 0,
        logger_cfg.log_interval,
    )
    history_wct: collections.deque[float] = collections.deque(maxlen=window + 1)
    total_loss_dict: dict[str, Any] = {}
    report_memory_flag = True
    flops_since_last_log = 0.0
    exit_code = 0
    prof: torch.profiler.profile | None = None
    nsys_context: TNvtxContext | None = None
    profiling = cfg.profiling
    profile_here = should_profile_rank(profiling)
    seq_length = int(getattr(cfg.model, "seq_length", 0) or 0)
    total_iters = _total_iterations(cfg)
    straggler = state.straggler_timing
    nvrx = state.nvrx_straggler
    timed_step = nvrx.wrap(train_step) if nvrx is not None else train_step
    progress = ProgressReporter(
        max(total_iters or 1, train_state.step, 1),
        start=min(train_state.step, max(total_iters or 1, 1)),
        enabled=_rank() == _world_size() - 1 and _stdout_is_terminal(),
    )

    async_saves = bool(
        cfg.checkpoint is not None and cfg.checkpoint.save and cfg.checkpoint.async_save
    )
    if async_saves:
        from bridge.train.checkpointing import finalize_async_saves

    def save_now() -> None:
        save_checkpoint_and_time(
            state,
            model,
            optimizer,
            scheduler,
            train_state.floating_point_operations_so_far,
            checkpointing_context,
            train_data_iterator=train_data_iterator,
        )

    timers("interval-time", log_level=0).start(barrier=True)
    try:
        with progress:
            while not _run_is_done(cfg, train_state):
                update_num_microbatches(train_state.consumed_train_samples)
                if (
                    profile_here
                    and profiling is not None
                    and prof is None
                    and nsys_context is None
                    and profiling.profile_step_start
                    <= train_state.step
                    < profiling.profile_step_end
                ):
                    prof, nsys_context = start_profiler(cfg)
                state.fault_tolerance.on_step_start()
                # Straggler timing of the step happens inside the forward step (see
                # bridge.train.forward_step), where the gradient all-reduce is not.
                (
                    loss_dict,
                    skipped_iter,
                    should_checkpoint,
                    should_exit,
                    step_exit_code,
                    grad_norm,
                    num_zeros_in_grad,
                ) = timed_step(step_func, train_data_iterator, model, optimizer, scheduler, state)
                if should_checkpoint and cfg.checkpoint is not None and cfg.checkpoint.save:
                    save_now()
                if should_exit:
                    exit_code = step_exit_code
                    state.fault_tolerance.on_step_end()
                    break

                batch_size = get_num_microbatches() * micro_batch_size * dp_size
                step_flops = num_floating_point_operations(cfg.model, batch_size)
                train_state.step += 1
                train_state.consumed_train_samples += batch_size
                if skipped_iter:
                    train_state.skipped_train_samples += batch_size
                train_state.floating_point_operations_so_far += step_flops
                flops_since_last_log += step_flops
                history_wct.append(time.time() - state.start_time)

                learning_rate, decoupled_learning_rate = _learning_rates(optimizer)
                params_norm = (
                    calc_params_l2_norm(model, cfg.model) if logger_cfg.log_params_norm else None
                )
                report_memory_flag = training_log(
                    loss_dict,
                    total_loss_dict,
                    learning_rate,
                    decoupled_learning_rate,
                    float(optimizer.get_loss_scale()),
                    report_memory_flag,
                    skipped_iter,
                    grad_norm,
                    params_norm,
                    num_zeros_in_grad,
                    cfg,
                    state,
                    history_wct,
                    model,
                    loaded_iteration=state.loaded_iteration,
                    seq_length=seq_length or None,
                )
                if "lm loss" in loss_dict:
                    progress.update(train_state.step, {"lm loss": float(loss_dict["lm loss"])})
                else:
                    progress.update(train_state.step)

                post_training_step_callbacks(
                    model,
                    flops_since_last_log,
                    straggler,
                    train_state.step,
                    prof,
                    cfg,
                    toggle_hooks,
                    nsys_context,
                    fault_tolerance=state.fault_tolerance,
                )
                if train_state.step % logger_cfg.log_interval == 0:
                    flops_since_last_log = 0.0
                if profiling is not None and train_state.step >= profiling.profile_step_end:
                    prof, nsys_context = None, None
                if nvrx is not None:
                    nvrx.poll()

                if async_saves:
                    # Commit background saves that finished (collective, non-blocking).
                    finalize_async_saves(state, blocking=False)

                if (
                    train_cfg.eval_interval
                    and train_state.step % train_cfg.eval_interval == 0
                    and train_state.do_valid
                    and valid_data_iterator is not None
                ):
                    timers("interval-time").stop()
                    # Evaluation must see whole parameters, not ones a pending overlapped
                    # all-gather would still overwrite.
                    if toggle_hooks:
                        disable_forward_pre_hook(model)
                    evaluate_and_print_results(
                        state,
                        f"iteration {train_state.step}",
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
                    state.last_evaluated_iteration = train_state.step
                    timers("interval-time", log_level=0).start(barrier=True)

                if checkpoint_and_decide_exit(
                    state,
                    model,
                    optimizer,
                    scheduler,
                    train_state.floating_point_operations_so_far,
                    checkpointing_context,
                    train_data_iterator,
                ):
                    break

        if prof is not None or nsys_context is not None:
            stop_profiler(prof, nsys_context)
            prof, nsys_context = None, None
        checkpoint = cfg.checkpoint
        if (
            exit_code == 0
            and checkpoint is not None
            and checkpoint.save is not None
            and train_state.step > 0
            and state.last_saved_iteration != train_state.step
        ):
            save_now()
        timers("interval-time").stop()
        _finish_train(state)
    finally:
        if prof is not None or nsys_context is not None:
            stop_profiler(prof, nsys_context)
        if train_cfg.manual_gc and gc_was_enabled:
            gc.enable()
        if owns_calculator:
            release_num_microbatches_calculator()
    return exit_code


def _stdout_is_terminal() -> bool:
    import sys

    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False
