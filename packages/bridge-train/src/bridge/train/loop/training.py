"""GPT-style training: a run's components, built from their sections on first use, and the loop.

:class:`RunComponents` is the one place a ``GlobalState`` is taken apart, for ``pretrain``,
the eval-only run and the reference's adapters (:mod:`bridge.train.api`), so an adapter
that needs one part builds only that part. :func:`run_training` runs them with
:func:`core_utils.loop.run_loop`. No part holds the whole config or the ``GlobalState``
(callbacks see ``LoopContext.state``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch
from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator

from bridge.config import ConfigContainer
from bridge.logging import MetricWriters, TrainingLogSettings, tokens_per_sample
from bridge.train.data.tokenizers import Tokenizer
from bridge.train.loop.batch_size import ensure_num_microbatches_calculator
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
from bridge.train.loop.run_ends import run_teardown_steps
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

__all__ = ["LoggedRun", "RunComponents", "run_training"]


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
    """A GPT run's parts, from the sections of ``state.cfg`` (or ``config``) and the live
    objects of ``state`` (the engine's schedule, timers, writers, resiliency objects,
    counters); each part is built once, when first used.

    The parts: ``run`` (counters, timers, writers, start time), ``step`` and ``evaluation``
    (both need ``forward_step_func``), ``checkpoint_writer`` (``None`` without a
    ``checkpoint`` section) with its ``progress_log`` (``None``: not kept), and ``loop``,
    the loop's components in order (also needs the ``train`` and ``logger`` sections).

    Attributes:
        state: The run's state, filled (by :func:`bridge.train.setup` or the caller).
        forward_step_func: The forward step (the state is injected if it asks).
        checkpointing_context: The checkpointing context the writer keeps between saves.
        process_non_loss_data_func: See :func:`bridge.train.evaluate_and_print_results`.
        non_loss_data_func: See :func:`bridge.train.evaluate`.
        callbacks: The caller's callbacks, run after the config's ``callbacks``.
        tokenizer: The run's tokenizer (the ``samples`` section generates with it).
        config: The config whose sections the parts read (``None``: ``state.cfg``); the
            reference's evaluation functions are given one.
    """

    state: GlobalState
    forward_step_func: ForwardStepCallable | None = None
    checkpointing_context: dict[str, Any] = field(default_factory=dict)
    process_non_loss_data_func: Callable[..., Any] | None = None
    non_loss_data_func: Callable[..., Any] | None = None
    callbacks: Sequence[Callback] = ()
    tokenizer: Tokenizer | None = None
    config: ConfigContainer | None = None

    @cached_property
    def run(self) -> LoggedRun:
        """The run's counters, timers, writers and start time."""
        state = self.state
        return LoggedRun(state.train_state, state.timers, state.metric_writers, state.start_time)

    def __post_init__(self) -> None:
        self.cfg = cfg = self.state.cfg if self.config is None else self.config
        self._toggle_hooks = should_toggle_forward_pre_hook(cfg.ddp, cfg.optimizer)
        self._seq_length = int(getattr(cfg.model, "seq_length", 0) or 0)

    @cached_property
    def _forward_step(self) -> ForwardStepCallable:
        if self.forward_step_func is None:
            raise ValueError("RunComponents: the train step and evaluation need a forward step")
        return prepare_forward_step_func(self.forward_step_func, self.state)

    @cached_property
    def step(self) -> TrainStep:
        """The train step (``train``, ``model``, ``ddp`` sections; the engine's schedule)."""
        state, cfg = self.state, self.cfg
        assert cfg.train is not None, "the train section is required"
        return TrainStep(
            forward_step_func=self._forward_step,
            forward_backward_func=state.forward_backward_func,
            train=cfg.train,
            model_config=cfg.model,
            ddp_config=cfg.ddp,
            timers=state.timers,
            nvrx_straggler=state.nvrx_straggler,
        )

    @cached_property
    def evaluation(self) -> Evaluation:
        """The evaluation (``train`` section; ``logger.log_validation_ppl_to_tensorboard``)."""
        state, cfg = self.state, self.cfg
        assert cfg.train is not None, "the train section is required"
        return Evaluation(
            forward_step_func=self._forward_step,
            forward_backward_func=state.forward_backward_func,
            train=cfg.train,
            seq_length=self._seq_length,
            train_state=state.train_state,
            state=self.run,
            fault_tolerance=state.fault_tolerance,
            log_ppl=bool(cfg.logger is not None and cfg.logger.log_validation_ppl_to_tensorboard),
            process_non_loss_data_func=self.process_non_loss_data_func,
            non_loss_data_func=self.non_loss_data_func,
            toggle_forward_pre_hooks=self._toggle_hooks,
        )

    @cached_property
    def progress_log(self) -> ProgressLog | None:
        """``progress.txt`` (``None``: not kept: ``logger.log_progress`` off, or no
        ``checkpoint.save``)."""
        if self.cfg.logger is None or not self.cfg.logger.log_progress:
            return None
        return ProgressLog.in_save_dir(
            self.cfg.checkpoint,
            seq_length=self._seq_length,
            start_time=self.state.start_time,
            job_start_flops=self.state.job_start_flops,
        )

    @cached_property
    def checkpoint_writer(self) -> CheckpointWriter | None:
        """The checkpoint writer (``None``: no ``checkpoint`` section)."""
        state, checkpoint = self.state, self.cfg.checkpoint
        if checkpoint is None:
            return None
        return CheckpointWriter(
            checkpoint,
            self.cfg,
            self.checkpointing_context,
            metric_writers=state.metric_writers,
            fault_tolerance=state.fault_tolerance,
            timers=state.timers,
            toggle_forward_pre_hooks=self._toggle_hooks,
            progress_log=self.progress_log,
        )

    @cached_property
    def loop(self) -> list[Callback]:
        """The loop's components in order (needs a forward step and the ``train`` and
        ``logger`` sections)."""
        state, cfg = self.state, self.cfg
        train, logger_cfg, checkpoint = cfg.train, cfg.logger, cfg.checkpoint
        assert train and logger_cfg, "a loop needs the train and logger sections"
        metrics = MetricsProcessor(
            TrainingLogSettings(
                logger=logger_cfg,
                train=train,
                profiling=cfg.profiling,
                seq_length=tokens_per_sample(cfg.model, cfg.dataset),
                data_parallel_size=cfg.data_parallel_size,
            ),
            self.run,
            model_config=cfg.model,
            loaded_iteration=state.loaded_iteration,
        )
        return standard_components(
            metrics=metrics,
            train=train,
            log_interval=logger_cfg.log_interval,
            checkpoint=checkpoint,
            save=self.checkpoint_writer,
            resiliency=state.resiliency,
            profiling=cfg.profiling,
            profile_trace_dir=profile_trace_dir(logger_cfg, checkpoint),
            evaluate=self.evaluation if state.train_state.do_valid else None,
            timers=state.timers,
            toggle_forward_pre_hooks=self._toggle_hooks,
            samples=cfg.samples,
            tokenizer=self.tokenizer,
            seq_length=getattr(cfg.model, "seq_length", None),
            metric_writers=state.metric_writers,
        )


def run_training(
    components: RunComponents,
    model: list[torch.nn.Module],
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    train_data_iterator: Any,
    valid_data_iterator: Any,
) -> int:
    """:func:`bridge.train.train` over built components (what :func:`bridge.train.pretrain`
    calls): the loop, then the end of training; the state's ``last_saved_iteration`` and
    ``last_evaluated_iteration`` are this loop's afterwards.

    Args:
        components: A :class:`RunComponents` with a forward step.
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
    step, run, state = components.step, components.run, components.state
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
        callbacks=loop_callback_list(
            components.loop, [*components.cfg.callbacks, *components.callbacks]
        ),
        state=state,
    )
    run.timers("interval-time", log_level=0).start(barrier=True)
    try:
        exit_code = run_loop(
            context, step, is_done=lambda c: run_is_done(step.train, c.train_state)
        )
        run.timers("interval-time").stop()
        end_steps = run_teardown_steps(
            components.cfg.checkpoint,
            state.resiliency,
            state.metric_writers,
            clean=True,
            close_writers=False,
        )
        for _, action in end_steps:
            action()
    finally:
        close_components(components.loop)
        if owns_calculator:
            destroy_num_microbatches_calculator()
        loop = components.loop
        evaluated = (c.last_evaluated_iteration for c in loop if isinstance(c, Evaluator))
        saved = (c.last_saved_iteration for c in loop if isinstance(c, Checkpointer))
        state.last_evaluated_iteration = next(evaluated, None)
        state.last_saved_iteration = next(saved, None)
    return exit_code
