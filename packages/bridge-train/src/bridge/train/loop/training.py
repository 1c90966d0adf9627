"""GPT-style training: a run's components, built once from their sections, and the loop.

:func:`run_components` is the one place a ``GlobalState`` is taken apart: it builds the
:class:`~bridge.train.loop.step.TrainStep` (``train``, ``model``, ``ddp``, the engine's
schedule), the :class:`~bridge.train.loop.eval.Evaluation` (``train``), the
:class:`~bridge.train.loop.saving.CheckpointWriter` (``checkpoint``) with its ``progress.txt``
(``logger``) and, for a loop, the :class:`~bridge.train.loop.components.MetricsProcessor`
(``logger``, ``train``, ``profiling``) and the other components
(:func:`~bridge.train.loop.components.standard_components`), for ``pretrain``, the eval-only
run and the reference's adapters (:mod:`bridge.train.api`). :func:`run_training` runs them
over the model, optimizer, scheduler and iterators with :func:`core_utils.loop.run_loop`.
No part holds the whole config or the ``GlobalState`` (callbacks see ``LoopContext.state``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

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

__all__ = ["LoggedRun", "RunComponents", "run_components", "run_training"]


@dataclass(frozen=True)
class LoggedRun:
    """What the metrics and the evaluation log read of a run (a
    :class:`bridge.logging.LoggingState`): its counters, timers, writers and start time."""

    train_state: TrainState
    timers: Timers
    metric_writers: MetricWriters
    start_time: float


@dataclass
class RunComponents:
    """A GPT run's parts, each built once by :func:`run_components`.

    Attributes:
        run: The run's counters, timers, writers and start time.
        step: The train step (``None``: built without a forward step).
        evaluation: The evaluation (``None``: built without a forward step).
        checkpoint_writer: The checkpoint writer (``None``: no ``checkpoint`` section).
        progress_log: ``progress.txt`` (``None``: not kept).
        loop: The loop's components in order (empty: not built for a loop).
        callbacks: The config's ``callbacks``, then the caller's.
        end_steps: What ends a finished loop (:func:`run_teardown_steps`, writers flushed).
        callback_state: ``LoopContext.state``, for the user's callbacks (no component reads it).
    """

    run: LoggedRun
    step: TrainStep | None
    evaluation: Evaluation | None
    checkpoint_writer: CheckpointWriter | None
    progress_log: ProgressLog | None
    loop: list[Callback] = field(default_factory=list)
    callbacks: list[Callback] = field(default_factory=list)
    end_steps: list[TeardownStep] = field(default_factory=list)
    callback_state: GlobalState | None = None

    @property
    def last_evaluated_iteration(self) -> int | None:
        """Iteration of the loop's last validation run (``None``: none yet)."""
        found = (c.last_evaluated_iteration for c in self.loop if isinstance(c, Evaluator))
        return next(found, None)

    @property
    def last_saved_iteration(self) -> int | None:
        """Iteration of the loop's last persistent checkpoint (``None``: none yet)."""
        found = (c.last_saved_iteration for c in self.loop if isinstance(c, Checkpointer))
        return next(found, None)


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
        state: The run's state, filled (by :func:`bridge.train.setup` or the caller).
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
    parts = RunComponents(logged, step, evaluation, writer, progress_log)
    if not loop:
        return parts
    assert step and train and logger_cfg, "a loop needs a forward step, train and logger"
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
    parts.loop = standard_components(
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
    parts.callbacks = [*cfg.callbacks, *callbacks]
    parts.end_steps = run_teardown_steps(
        checkpoint, state.resiliency, state.metric_writers, clean=True, close_writers=False
    )
    parts.callback_state = state
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
    step, run = components.step, components.run
    assert step is not None and components.loop, "build the components with loop=True"
    owns_calculator = ensure_num_microbatches_calculator(step.train, data_parallel_size())
    for chunk in model:
        chunk.train()
    context = LoopContext(
        run.train_state,
        model,
        optimizer,
        scheduler,
        train_data_iterator,
        valid_data_iterator,
        callbacks=loop_callback_list(components.loop, components.callbacks),
        state=components.callback_state,
    )
    run.timers("interval-time", log_level=0).start(barrier=True)
    try:
        exit_code = run_loop(
            context, step, is_done=lambda c: run_is_done(step.train, c.train_state)
        )
        run.timers("interval-time").stop()
        for _, action in components.end_steps:
            action()
    finally:
        close_components(components.loop)
        if owns_calculator:
            release_num_microbatches_calculator()
    return exit_code


def _no_save(context: LoopContext, non_persistent: bool) -> None:
    """The save of a run without a ``checkpoint`` section (never called: nothing saves)."""
    raise AssertionError("no checkpoint section: the checkpointer never saves")
