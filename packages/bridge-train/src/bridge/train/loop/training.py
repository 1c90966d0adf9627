"""GPT-style training: a run's components, built once from their sections, and the loop
that runs them.

:func:`run_components` is the one place where a run's ``GlobalState`` is taken apart: it
builds each part from its own section and the live objects it uses, the
:class:`~bridge.train.loop.step.TrainStep` (``train``, ``model``, ``ddp`` and the engine's
schedule), the :class:`~bridge.train.loop.eval.Evaluation` (``train``), the
:class:`~bridge.train.loop.saving.CheckpointWriter` (``checkpoint``) with its
:class:`~bridge.train.loop.progress_log.ProgressLog` (``logger``, ``checkpoint``) and, for a
loop, the :class:`~bridge.train.loop.components.MetricsProcessor` (``logger``, ``train``,
``profiling``) and the other components
(:func:`bridge.train.loop.components.standard_components`). ``pretrain``, the ``--eval-only``
run and the reference's functions (``train``, ``train_step``, ``evaluate``, ... in
:mod:`bridge.train.api`) call it and use the parts they need. :func:`run_training` takes the
built components with the model, optimizer, scheduler and iterators and runs the
model-agnostic driver :func:`core_utils.loop.run_loop`; it returns the process exit code (0
unless the rerun state machine asks for another). Nothing built here holds the whole config
or reads the ``GlobalState``: the user's callbacks find it in ``LoopContext.state``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from bridge.config import TrainingConfig
from bridge.logging import MetricWriters, TrainingLogSettings, tokens_per_sample
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
from bridge.train.loop.run_ends import TeardownStep, run_teardown_steps
from bridge.train.loop.run_length import run_is_done
from bridge.train.loop.saving import CheckpointWriter
from bridge.train.loop.state_injection import prepare_forward_step_func
from bridge.train.loop.step import TrainStep, data_parallel_size
from bridge.train.state import ForwardStepCallable, GlobalState, TrainState
from core_utils import Timers
from core_utils.callbacks import Callback
from core_utils.loop import LoopContext, run_loop

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

__all__ = ["LoggedRun", "LoopParts", "RunComponents", "run_components", "run_training"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoggedRun:
    """What the metrics and the evaluation log read of a run (a
    :class:`bridge.logging.LoggingState`): its counters, timers, writers and start time."""

    train_state: TrainState
    timers: Timers
    metric_writers: MetricWriters
    start_time: float


@dataclass
class LoopParts:
    """What :func:`run_training` runs besides the step.

    Attributes:
        components: The loop's components in order
            (:func:`~bridge.train.loop.components.standard_components`).
        callbacks: The config's ``callbacks``, then the caller's.
        train: The ``train`` section (run length, micro-batch calculator).
        train_state: The counters the loop advances.
        timers: The run's timers (``interval-time`` runs during the loop).
        end_steps: What ends a run whose loop finished, in order: pending asynchronous saves
            committed, the resiliency machinery stopped cleanly (computed fault-tolerance
            timeouts stored; the exit-signal handler restored after the last save), the
            metric writers flushed.
        callback_state: What ``LoopContext.state`` shows the user's callbacks (the run's
            ``GlobalState``); no component reads it.
    """

    components: list[Callback]
    callbacks: list[Callback]
    train: TrainingConfig
    train_state: TrainState
    timers: Timers
    end_steps: list[TeardownStep]
    callback_state: GlobalState


@dataclass
class RunComponents:
    """A GPT run's parts, each built once by :func:`run_components`.

    Attributes:
        step: The train step (``None``: built without a forward step).
        evaluation: The evaluation (``None``: built without a forward step).
        checkpoint_writer: The checkpoint writer (``None``: no ``checkpoint`` section).
        progress_log: ``progress.txt`` (``None``: not kept).
        loop: The loop's components (``None``: not built for a loop).
    """

    step: TrainStep | None
    evaluation: Evaluation | None
    checkpoint_writer: CheckpointWriter | None
    progress_log: ProgressLog | None
    loop: LoopParts | None = None

    @property
    def last_evaluated_iteration(self) -> int | None:
        """Iteration of the loop's last validation run (``None``: none yet)."""
        loop = self.loop.components if self.loop is not None else []
        found = [c.last_evaluated_iteration for c in loop if isinstance(c, Evaluator)]
        return found[0] if found else None

    @property
    def last_saved_iteration(self) -> int | None:
        """Iteration of the loop's last persistent checkpoint (``None``: none yet)."""
        loop = self.loop.components if self.loop is not None else []
        found = [c.last_saved_iteration for c in loop if isinstance(c, Checkpointer)]
        return found[0] if found else None


def run_components(
    state: GlobalState,
    forward_step_func: ForwardStepCallable | None = None,
    checkpointing_context: dict[str, Any] | None = None,
    process_non_loss_data_func: Callable[..., Any] | None = None,
    non_loss_data_func: Callable[..., Any] | None = None,
    *,
    loop: bool = False,
    callbacks: Sequence[Callback] = (),
    tokenizer: Tokenizer | None = None,
) -> RunComponents:
    """Build a run's parts from the sections of ``state.cfg`` and the live objects of
    ``state`` (the engine's schedule, timers, writers, resiliency objects, counters).

    Args:
        state: The run's state, after :func:`bridge.train.setup` (or filled by the caller).
        forward_step_func: The forward step (the state is injected if it asks); without
            one, no step and no evaluation are built.
        checkpointing_context: The checkpointing context the writer keeps between saves.
        process_non_loss_data_func: See :func:`bridge.train.evaluate_and_print_results`.
        non_loss_data_func: See :func:`bridge.train.evaluate`.
        loop: Also build the loop's components (needs a forward step and the ``train`` and
            ``logger`` sections).
        callbacks: The caller's callbacks, run after the config's ``callbacks``.
        tokenizer: The run's tokenizer (the ``samples`` section generates with it).

    Returns:
        The parts.
    """
    cfg = state.cfg
    train, logger_cfg, checkpoint = cfg.train, cfg.logger, cfg.checkpoint
    seq_length = int(getattr(cfg.model, "seq_length", 0) or 0)
    toggle_hooks = should_toggle_forward_pre_hook(cfg.ddp, cfg.optimizer)
    logged = LoggedRun(state.train_state, state.timers, state.metric_writers, state.start_time)
    step = evaluation = None
    if forward_step_func is not None:
        assert train is not None, "the train section is required"
        forward_step_func = prepare_forward_step_func(forward_step_func, state)
        step = TrainStep(
            forward_step_func=forward_step_func,
            forward_backward_func=state.forward_backward_func,
            train=train,
            model_config=cfg.model,
            ddp_config=cfg.ddp,
            timers=state.timers,
            nvrx_straggler=state.nvrx_straggler,
        )
        evaluation = Evaluation(
            forward_step_func=forward_step_func,
            forward_backward_func=state.forward_backward_func,
            train=train,
            seq_length=seq_length,
            train_state=state.train_state,
            state=logged,
            fault_tolerance=state.fault_tolerance,
            log_ppl=bool(logger_cfg is not None and logger_cfg.log_validation_ppl_to_tensorboard),
            process_non_loss_data_func=process_non_loss_data_func,
            non_loss_data_func=non_loss_data_func,
            toggle_forward_pre_hooks=toggle_hooks,
        )
    progress_log = ProgressLog.from_config(
        logger_cfg,
        checkpoint,
        seq_length=seq_length,
        start_time=state.start_time,
        job_start_flops=state.job_start_flops,
    )
    writer = None
    if checkpoint is not None:
        writer = CheckpointWriter(
            checkpoint,
            cfg,
            checkpointing_context if checkpointing_context is not None else {},
            metric_writers=state.metric_writers,
            fault_tolerance=state.fault_tolerance,
            timers=state.timers,
            toggle_forward_pre_hooks=toggle_hooks,
            progress_log=progress_log,
        )
    parts = RunComponents(step, evaluation, writer, progress_log)
    if not loop:
        return parts
    assert step is not None, "a loop needs a forward step"
    assert train is not None and logger_cfg is not None, "train and logger sections required"
    metrics = MetricsProcessor(
        TrainingLogSettings(
            logger=logger_cfg,
            train=train,
            profiling=cfg.profiling,
            seq_length=tokens_per_sample(cfg.model, cfg.dataset),
            data_parallel_size=cfg.data_parallel_size,
        ),
        logged,
        model_config=cfg.model,
        loaded_iteration=state.loaded_iteration,
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
        evaluate=evaluation if state.train_state.do_valid else None,
        timers=state.timers,
        toggle_forward_pre_hooks=toggle_hooks,
        samples=cfg.samples,
        tokenizer=tokenizer,
        seq_length=getattr(cfg.model, "seq_length", None),
        metric_writers=state.metric_writers,
    )
    parts.loop = LoopParts(
        components=components,
        callbacks=[*cfg.callbacks, *callbacks],
        train=train,
        train_state=state.train_state,
        timers=state.timers,
        end_steps=run_teardown_steps(
            checkpoint, state.resiliency, state.metric_writers, clean=True, close_writers=False
        ),
        callback_state=state,
    )
    return parts


def run_training(
    components: RunComponents,
    model: list[torch.nn.Module],
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    train_data_iterator: Any,
    valid_data_iterator: Any,
) -> int:
    """:func:`bridge.train.train` over built components (what :func:`bridge.train.pretrain`
    calls): the loop, then the end of training.

    Args:
        components: From :func:`run_components` with ``loop=True``.
        model: See :func:`bridge.train.train`.
        optimizer: See :func:`bridge.train.train`.
        scheduler: See :func:`bridge.train.train`.
        train_data_iterator: See :func:`bridge.train.train`.
        valid_data_iterator: See :func:`bridge.train.train`.

    Returns:
        The process exit code (see :func:`bridge.train.train`).

    Raises:
        core_utils.CallbackError: A user callback raised (names callback, hook, iteration).
    """
    parts, step = components.loop, components.step
    assert parts is not None and step is not None, "build the components with loop=True"
    owns_calculator = ensure_num_microbatches_calculator(parts.train, data_parallel_size())
    for chunk in model:
        chunk.train()
    context = LoopContext(
        parts.train_state,
        model,
        optimizer,
        scheduler,
        train_data_iterator,
        valid_data_iterator,
        callbacks=loop_callback_list(parts.components, parts.callbacks),
        state=parts.callback_state,
    )
    parts.timers("interval-time", log_level=0).start(barrier=True)
    try:
        exit_code = run_loop(
            context, step, is_done=lambda c: run_is_done(parts.train, c.train_state)
        )
        parts.timers("interval-time").stop()
        for _, action in parts.end_steps:
            action()
    finally:
        close_components(parts.components)
        if owns_calculator:
            release_num_microbatches_calculator()
    return exit_code


def _no_save(context: LoopContext, non_persistent: bool) -> None:
    """The save of a run without a ``checkpoint`` section (never called: nothing saves)."""
    raise AssertionError("no checkpoint section: the checkpointer never saves")
