"""GPT-style training on the loop: the step, and the run that puts it together.

:func:`run_training` is where a run's configuration and state are taken apart: it builds
the :class:`TrainStep` (the ``train``, ``model`` and ``ddp`` sections and the engine's
schedule), the metrics component (``logger``, ``train``, ``profiling``), the
:class:`~bridge.train.loop.eval.Evaluation` (``train``), the
:class:`~bridge.train.loop.saving.CheckpointWriter` (``checkpoint``) and the other components
(:func:`bridge.train.loop.components.standard_components`), each from its own section and
the live objects it uses, puts the user's callbacks after them, and hands the step to the
model-agnostic driver :func:`core_utils.loop.run_loop`. Nothing it builds sees the whole
config or the ``GlobalState``. Every save decision lives in the
:class:`~bridge.train.loop.components.Checkpointer`; every log line in the
:class:`~bridge.train.loop.components.MetricsProcessor`. The reference's own functions
(``train``, ``train_step``, ...) are adapters over these in :mod:`bridge.train.api.train`.
``run_training`` returns the process exit code (0 unless the rerun state machine asks for
another).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bridge.config import DDPConfigProtocol, TrainingConfig
from bridge.logging import TrainingLogSettings, tokens_per_sample
from bridge.resiliency import NVRxStragglerMonitor
from bridge.train.checkpointing.async_save import finalize_async_saves
from bridge.train.loop.batch_size import (
    ensure_num_microbatches_calculator,
    get_num_microbatches,
    release_num_microbatches_calculator,
    update_num_microbatches,
)
from bridge.train.loop.components import (
    Checkpointer,
    Evaluator,
    MetricsProcessor,
    close_components,
    loop_callback_list,
    standard_components,
)
from bridge.train.loop.eval import Evaluation
from bridge.train.loop.forward_pre_hooks import should_toggle_forward_pre_hook
from bridge.train.loop.losses import reduce_losses, zero_grad_buffers
from bridge.train.loop.profiling import profile_trace_dir
from bridge.train.loop.progress_log import ProgressLog
from bridge.train.loop.run_length import run_is_done
from bridge.train.loop.saving import CheckpointWriter
from bridge.train.loop.state_injection import prepare_forward_step_func
from bridge.train.metrics.flops import num_floating_point_operations
from bridge.train.state import ForwardStepCallable, GlobalState
from core_utils import Timers
from core_utils.callbacks import Callback
from core_utils.loop import LoopContext, StepResult, run_loop

__all__ = ["TrainStep", "run_training", "train_step_of"]

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
        self, data_iterator: Any, model: list[torch.nn.Module], optimizer: Any, scheduler: Any
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
        from megatron.core.rerun_state_machine import get_rerun_state_machine

        train = self.train
        assert train.micro_batch_size is not None
        timers = self.timers
        rerun_state_machine = get_rerun_state_machine()
        seq_length = int(getattr(self.model_config, "seq_length", 0) or 0)
        ddp = self.ddp_config
        num_microbatches = get_num_microbatches()

        losses_reduced: list[Any] = []
        while rerun_state_machine.should_run_forward_backward(data_iterator):
            zero_grad_buffers(model, optimizer)
            _handle_mxfp8_param_buffer_copy(
                optimizer,
                bool(getattr(ddp, "reuse_grad_buf_for_mxfp8_param_ag", False)),
                bool(getattr(ddp, "overlap_param_gather", False)),
            )
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
            flops=num_floating_point_operations(self.model_config, batch_size),
        )

    def __call__(self, context: LoopContext) -> StepResult:
        """The loop's step: the micro-batch count follows the ramp-up, then :meth:`run`."""
        update_num_microbatches(context.train_state.consumed_train_samples)
        if self._timed_run is None:  # wrapped once, for the loop only
            nvrx = self.nvrx_straggler
            self._timed_run = nvrx.wrap(self.run) if nvrx is not None else self.run
        result: StepResult = self._timed_run(
            context.train_data_iterator, context.model, context.optimizer, context.scheduler
        )
        return result


def train_step_of(forward_step_func: ForwardStepCallable, state: GlobalState) -> TrainStep:
    """The :class:`TrainStep` of a run's ``GlobalState`` (its config sections, engine,
    timers and NVRx monitor; the state is injected into the forward step if it asks)."""
    cfg = state.cfg
    assert cfg.train is not None
    return TrainStep(
        forward_step_func=prepare_forward_step_func(forward_step_func, state),
        forward_backward_func=state.forward_backward_func,
        train=cfg.train,
        model_config=cfg.model,
        ddp_config=cfg.ddp,
        timers=state.timers,
        nvrx_straggler=state.nvrx_straggler,
    )


# ----------------------------------------------------------------------------- the run


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
) -> int:
    """:func:`bridge.train.train` with user callbacks (what :func:`bridge.train.pretrain`
    calls): the components built from their sections, then the loop.

    Args:
        forward_step_func: See :func:`bridge.train.train`.
        model: See :func:`bridge.train.train`.
        optimizer: See :func:`bridge.train.train`.
        scheduler: See :func:`bridge.train.train`.
        train_data_iterator: See :func:`bridge.train.train`.
        valid_data_iterator: See :func:`bridge.train.train`.
        global_state: See :func:`bridge.train.train`.
        checkpointing_context: See :func:`bridge.train.train`.
        process_non_loss_data_func: See :func:`bridge.train.train`.
        non_loss_data_func: See :func:`bridge.train.train`.
        callbacks: User callbacks (:class:`bridge.train.Callback`), run after the loop's
            components and after the config's ``callbacks``.

    Returns:
        The process exit code (see :func:`bridge.train.train`).

    Raises:
        core_utils.CallbackError: A user callback raised (names callback, hook, iteration).
    """
    state, cfg = global_state, global_state.cfg
    train, logger_cfg, checkpoint = cfg.train, cfg.logger, cfg.checkpoint
    assert train is not None and logger_cfg is not None, "train and logger sections required"
    owns_calculator = ensure_num_microbatches_calculator(train, _data_parallel_size())
    for chunk in model:
        chunk.train()
    toggle_hooks = should_toggle_forward_pre_hook(cfg.ddp, cfg.optimizer)
    seq_length = tokens_per_sample(cfg.model, cfg.dataset)
    step = train_step_of(forward_step_func, state)
    metrics = MetricsProcessor(
        TrainingLogSettings(
            logger=logger_cfg,
            train=train,
            profiling=cfg.profiling,
            seq_length=seq_length,
            data_parallel_size=cfg.data_parallel_size,
        ),
        state,
        model_config=cfg.model,
        loaded_iteration=state.loaded_iteration,
    )
    evaluation = None
    if state.train_state.do_valid:
        evaluation = Evaluation(
            forward_step_func=step.forward_step_func,
            forward_backward_func=step.forward_backward_func,
            train=train,
            seq_length=int(getattr(cfg.model, "seq_length", 0) or 0),
            train_state=state.train_state,
            state=state,
            fault_tolerance=state.fault_tolerance,
            log_ppl=logger_cfg.log_validation_ppl_to_tensorboard,
            process_non_loss_data_func=process_non_loss_data_func,
            non_loss_data_func=non_loss_data_func,
            toggle_forward_pre_hooks=toggle_hooks,
        )
    writer = None
    if checkpoint is not None:
        writer = CheckpointWriter(
            checkpoint,
            cfg,
            checkpointing_context,
            metric_writers=state.metric_writers,
            fault_tolerance=state.fault_tolerance,
            timers=state.timers,
            toggle_forward_pre_hooks=toggle_hooks,
            progress_log=ProgressLog.from_config(
                logger_cfg,
                checkpoint,
                seq_length=seq_length or 0,
                start_time=state.start_time,
                job_start_flops=state.job_start_flops,
            ),
        )
    components = standard_components(
        metrics=metrics,
        train=train,
        log_interval=logger_cfg.log_interval,
        checkpoint=checkpoint,
        save=writer if writer is not None else _no_save,
        resiliency=state.resiliency,
        profiling=cfg.profiling,
        profile_trace_dir=profile_trace_dir(logger_cfg, checkpoint),
        evaluate=evaluation,
        timers=state.timers,
        toggle_forward_pre_hooks=toggle_hooks,
    )
    context = LoopContext(
        state.train_state,
        model,
        optimizer,
        scheduler,
        train_data_iterator,
        valid_data_iterator,
        callbacks=loop_callback_list(components, [*cfg.callbacks, *callbacks]),
        state=state,
    )
    state.timers("interval-time", log_level=0).start(barrier=True)
    try:
        exit_code = run_loop(context, step, is_done=lambda c: run_is_done(train, c.train_state))
        state.timers("interval-time").stop()
        for component in components:
            if isinstance(component, Evaluator):
                state.last_evaluated_iteration = component.last_evaluated_iteration
            elif isinstance(component, Checkpointer):
                state.last_saved_iteration = component.last_saved_iteration
        # The end of training (the reference's _finish_train): pending saves committed, then
        # the resiliency machinery stopped (fault tolerance cleanly: computed timeouts are
        # stored); the exit-signal handler is restored after the last save.
        if checkpoint is not None and checkpoint.save is not None:
            finalize_async_saves(state.fault_tolerance, blocking=True, terminate=True)
        for _, action in state.resiliency.teardown_steps(clean=True):
            action()
        state.metric_writers.flush()
    finally:
        close_components(components)
        if owns_calculator:
            release_num_microbatches_calculator()
    return exit_code


def _no_save(context: LoopContext, non_persistent: bool) -> None:
    """The save of a run without a ``checkpoint`` section (never called: nothing saves)."""
    raise AssertionError("no checkpoint section: the checkpointer never saves")
