"""GPT-style training from the reference's ``GlobalState``: the one place where a run's state
and configuration are taken apart.

:func:`run_training` (what ``pretrain`` and the reference's ``train`` run) and the helpers
below build each part of the loop from its own section and the live objects it uses: the
:class:`~bridge.train.loop.step.TrainStep` (``train``, ``model``, ``ddp`` and the engine's
schedule), the :class:`~bridge.train.loop.components.MetricsProcessor` (``logger``,
``train``, ``profiling``), the :class:`~bridge.train.loop.eval.Evaluation` (``train``), the
:class:`~bridge.train.loop.saving.CheckpointWriter` (``checkpoint``) and the other components
(:func:`bridge.train.loop.components.standard_components`). Then the user's callbacks join
them and the model-agnostic driver :func:`core_utils.loop.run_loop` runs the step. Nothing
built here sees the whole config or the ``GlobalState``. The reference's own functions
(``train``, ``train_step``, ``evaluate``, ...) are adapters over these in
:mod:`bridge.train.api`. ``run_training`` returns the process exit code (0 unless the rerun
state machine asks for another).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from bridge.logging import TrainingLogSettings, tokens_per_sample
from bridge.train.checkpointing.async_save import finalize_async_saves
from bridge.train.data.tokenizers import Tokenizer
from bridge.train.loop.batch_size import (
    ensure_num_microbatches_calculator,
    release_num_microbatches_calculator,
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
from bridge.train.loop.profiling import profile_trace_dir
from bridge.train.loop.progress_log import ProgressLog
from bridge.train.loop.run_length import run_is_done
from bridge.train.loop.saving import CheckpointWriter
from bridge.train.loop.state_injection import prepare_forward_step_func
from bridge.train.loop.step import TrainStep, data_parallel_size
from bridge.train.state import ForwardStepCallable, GlobalState
from core_utils.callbacks import Callback
from core_utils.loop import LoopContext, run_loop

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

__all__ = [
    "checkpoint_writer_of",
    "evaluation_of",
    "progress_log_of",
    "run_training",
    "train_step_of",
]

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------ the parts, from the state


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


def progress_log_of(state: GlobalState) -> ProgressLog | None:
    """The run's ``progress.txt`` (``logger.log_progress`` and ``checkpoint.save``), with this
    launch's start time and the FLOP counter it started training from."""
    cfg = state.cfg
    return ProgressLog.from_config(
        cfg.logger,
        cfg.checkpoint,
        seq_length=int(getattr(cfg.model, "seq_length", 0) or 0),
        start_time=state.start_time,
        job_start_flops=state.job_start_flops,
    )


def checkpoint_writer_of(
    state: GlobalState, checkpointing_context: dict[str, Any]
) -> CheckpointWriter:
    """The run's :class:`~bridge.train.loop.saving.CheckpointWriter` (its ``checkpoint``
    section and run config; the writers, fault tolerance and timers of the state)."""
    cfg = state.cfg
    assert cfg.checkpoint is not None
    return CheckpointWriter(
        cfg.checkpoint,
        cfg,
        checkpointing_context,
        metric_writers=state.metric_writers,
        fault_tolerance=state.fault_tolerance,
        timers=state.timers,
        toggle_forward_pre_hooks=should_toggle_forward_pre_hook(cfg.ddp, cfg.optimizer),
        progress_log=progress_log_of(state),
    )


def evaluation_of(
    forward_step_func: ForwardStepCallable,
    state: GlobalState,
    process_non_loss_data_func: Callable[..., Any] | None = None,
    non_loss_data_func: Callable[..., Any] | None = None,
) -> Evaluation:
    """The run's :class:`~bridge.train.loop.eval.Evaluation` (its ``train`` section, the
    engine's schedule, fault tolerance, counters and writers; the state is injected into
    the forward step if it asks)."""
    cfg = state.cfg
    assert cfg.train is not None
    return Evaluation(
        forward_step_func=prepare_forward_step_func(forward_step_func, state),
        forward_backward_func=state.forward_backward_func,
        train=cfg.train,
        seq_length=int(getattr(cfg.model, "seq_length", 0) or 0),
        train_state=state.train_state,
        state=state,
        fault_tolerance=state.fault_tolerance,
        log_ppl=bool(cfg.logger is not None and cfg.logger.log_validation_ppl_to_tensorboard),
        process_non_loss_data_func=process_non_loss_data_func,
        non_loss_data_func=non_loss_data_func,
        toggle_forward_pre_hooks=should_toggle_forward_pre_hook(cfg.ddp, cfg.optimizer),
    )


# ----------------------------------------------------------------------------- the run


def run_training(
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
    *,
    callbacks: Sequence[Callback] = (),
    tokenizer: Tokenizer | None = None,
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
        tokenizer: The run's tokenizer (the ``samples`` section generates with it).

    Returns:
        The process exit code (see :func:`bridge.train.train`).

    Raises:
        core_utils.CallbackError: A user callback raised (names callback, hook, iteration).
    """
    state, cfg = global_state, global_state.cfg
    train, logger_cfg, checkpoint = cfg.train, cfg.logger, cfg.checkpoint
    assert train is not None and logger_cfg is not None, "train and logger sections required"
    owns_calculator = ensure_num_microbatches_calculator(train, data_parallel_size())
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
    evaluation = (
        evaluation_of(forward_step_func, state, process_non_loss_data_func, non_loss_data_func)
        if state.train_state.do_valid
        else None
    )
    writer = checkpoint_writer_of(state, checkpointing_context) if checkpoint else None
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
        samples=cfg.samples,
        tokenizer=tokenizer,
        seq_length=getattr(cfg.model, "seq_length", None),
        metric_writers=state.metric_writers,
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
