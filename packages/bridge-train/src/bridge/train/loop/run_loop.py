"""The model-agnostic training loop: a step, and the ordered components that act after it.

:func:`run_loop` is the whole loop::

    callbacks.on_train_start(context)
    while no stop was requested and the run is not done:
        callbacks.on_step_start(context)
        context.step_result = step(context)          # one iteration, a StepResult
        advance train_state (iteration, samples, FLOPs)  # unless the step stopped the job
        callbacks.on_step_end(context)
    callbacks.on_train_end(context)

Everything else (metrics and logging, evaluation, checkpoint and exit decisions, profiler,
fault-tolerance heartbeats, straggler timing, weight-hash checks, garbage collection) is a
:class:`core_utils.Callback` component in the :class:`core_utils.CallbackList` the context
carries (see :mod:`bridge.train.loop.components`); users' callbacks follow the
components and see the same :class:`LoopContext`. GPT training passes
:func:`bridge.train.loop.training.run_train_step` (through ``gpt_step_function``); MIMO passes
its own step function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from bridge.train.state import GlobalState, TrainState
from core_utils.callbacks import CallbackList

__all__ = ["LoopContext", "StepFunction", "StepResult", "advance_train_state", "run_loop"]


@dataclass
class StepResult:
    """What one training iteration produced.

    Values stay where the step left them: losses (and, where the optimizer returns tensors,
    the gradient norm and zero count) are tensors on the training device, so reading them
    on the host (``float(...)``) waits for the device; the metrics processor does that only
    when a log line or metric record needs them.

    Attributes:
        losses: Token-averaged loss per name (0-d tensors), over all micro-batches and
            data-parallel ranks; empty except on the last pipeline stage.
        skipped: The optimizer did not apply the update (non-finite or too large gradients).
        grad_norm: Gradient norm, when the optimizer computed one.
        num_zeros_in_grad: Zeros in the gradient, when counted.
        should_checkpoint: The rerun state machine asks for a checkpoint.
        should_exit: The rerun state machine stops the job: the iteration did not
            complete (``train_state`` is not advanced).
        exit_code: The process exit code the rerun state machine asks for.
        num_samples: Samples of the global batch this iteration trained on.
        flops: Floating-point operations of this iteration (all ranks).
    """

    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    skipped: bool = False
    grad_norm: torch.Tensor | float | None = None
    num_zeros_in_grad: torch.Tensor | int | None = None
    should_checkpoint: bool = False
    should_exit: bool = False
    exit_code: int = 0
    num_samples: int = 0
    flops: float = 0.0

    @property
    def completed(self) -> bool:
        """Whether the iteration ran to its end (the rerun state machine did not stop it)."""
        return not self.should_exit

    def as_tuple(
        self,
    ) -> tuple[dict[str, torch.Tensor], int, bool, bool, int, float | None, int | None]:
        """The reference's 7-tuple ``(loss_dict, skipped_iter, should_checkpoint, should_exit,
        exit_code, grad_norm, num_zeros_in_grad)`` with host values for the norms."""
        return (
            self.losses,
            int(self.skipped),
            self.should_checkpoint,
            self.should_exit,
            self.exit_code,
            None if self.grad_norm is None else float(self.grad_norm),
            None if self.num_zeros_in_grad is None else int(self.num_zeros_in_grad),
        )


@dataclass(eq=False)
class LoopContext:
    """The state every component and callback sees (the ``context`` of every hook).

    Attributes:
        state: The run's global state (config, counters, timers, writers, resiliency).
        model: Model chunks.
        optimizer: The optimizer.
        scheduler: The learning-rate scheduler.
        train_data_iterator: Training iterator (its position is saved in checkpoints).
        valid_data_iterator: Validation iterator, if any.
        callbacks: The loop's components followed by the user's callbacks.
        step_result: The latest iteration's result (``None`` before the first step).
        stop_requested: A component asked the loop to stop after this iteration.
        stop_reason: Why (the first request's reason).
        exit_code: The process exit code :func:`run_loop` returns.
    """

    state: GlobalState
    model: list[torch.nn.Module]
    optimizer: Any
    scheduler: Any
    train_data_iterator: Any = None
    valid_data_iterator: Any = None
    callbacks: CallbackList = field(default_factory=CallbackList)
    step_result: StepResult | None = None
    stop_requested: bool = False
    stop_reason: str | None = None
    exit_code: int = 0

    @property
    def iteration(self) -> int:
        """Iterations completed so far (``train_state.step``)."""
        return int(self.state.train_state.step)

    @property
    def train_state(self) -> TrainState:
        """The run's progress counters (saved in checkpoints)."""
        return self.state.train_state

    @property
    def config(self) -> Any:
        """The run's ``ConfigContainer``."""
        return self.state.cfg

    @property
    def step_flops(self) -> float:
        """FLOPs of the latest completed iteration (0 before the first one)."""
        result = self.step_result
        return 0.0 if result is None or not result.completed else result.flops

    def request_stop(self, reason: str, exit_code: int = 0) -> None:
        """Ask the loop to stop after the current iteration's components have run.

        The first request names the reason; a later non-zero exit code replaces a zero one,
        so a failure is never reported as success.

        Args:
            reason: Why, for the log (e.g. ``"exit signal received"``).
            exit_code: Process exit code to return.
        """
        if not self.stop_requested:
            self.stop_requested = True
            self.stop_reason = reason
            self.exit_code = exit_code
        elif exit_code != 0 and self.exit_code == 0:
            self.exit_code = exit_code

    def validation(self, run: Callable[[], Any]) -> Any:
        """Run an evaluation between the ``on_validation_start`` and ``_end`` hooks.

        Args:
            run: The evaluation (no arguments).

        Returns:
            What ``run`` returned.
        """
        self.callbacks.on_validation_start(self)
        out = run()
        self.callbacks.on_validation_end(self)
        return out

    def saved(self) -> None:
        """Tell every callback a checkpoint was committed (fires ``on_save``)."""
        self.callbacks.on_save(self)


#: One training iteration: gets the context, returns its result (``train_state`` untouched).
StepFunction = Callable[[LoopContext], StepResult]


def advance_train_state(train_state: TrainState, result: StepResult) -> None:
    """Count a completed iteration: step, consumed (and skipped) samples, FLOPs."""
    train_state.step += 1
    train_state.consumed_train_samples += result.num_samples
    if result.skipped:
        train_state.skipped_train_samples += result.num_samples
    train_state.floating_point_operations_so_far += result.flops


def run_loop(
    context: LoopContext, step: StepFunction, is_done: Callable[[LoopContext], bool]
) -> int:
    """Train until ``is_done`` or a stop request (see the module docstring).

    ``on_train_end`` runs when the loop ends normally or by a stop request; after an
    exception it does not (the caller's cleanup runs instead).

    Args:
        context: The loop's context (its ``callbacks`` are fired).
        step: Runs one iteration.
        is_done: Whether the run reached its length (checked before every iteration).

    Returns:
        ``context.exit_code``.
    """
    callbacks = context.callbacks
    callbacks.on_train_start(context)
    while not context.stop_requested and not is_done(context):
        callbacks.on_step_start(context)
        result = step(context)
        context.step_result = result
        if result.completed:
            advance_train_state(context.state.train_state, result)
        else:
            context.request_stop("the rerun state machine stopped the job", result.exit_code)
        callbacks.on_step_end(context)
    callbacks.on_train_end(context)
    return context.exit_code
