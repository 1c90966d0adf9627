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
fault-tolerance heartbeats, straggler timing, garbage collection) is a :class:`Callback`
component in the :class:`CallbackList` the context carries; users' callbacks join the same
list and see the same :class:`LoopContext`. Every training loop of the stack is this one:
bridge-train's GPT pretraining and finetuning, its MIMO recipe, bridge.mimo's
``train_mimo`` and the resiliency drills each pass their own step function and components.

The loop knows nothing about models, configs or the trainer's state: the context carries
the progress counters (any object with the fields of :class:`TrainProgress`), the model,
optimizer, scheduler and iterators as the step and the components use them, and, for the
user's callbacks, the trainer's own state object if it has one (``state``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from core_utils.callbacks import CallbackList

__all__ = [
    "LoopContext",
    "StepFunction",
    "StepResult",
    "TrainProgress",
    "advance_train_state",
    "run_loop",
]


class TrainProgress(Protocol):
    """The progress counters the loop advances after every completed step.

    bridge-train's ``TrainState`` has them; a loop of one's own can pass any object with
    these attributes (a small dataclass).

    Attributes:
        step: Iterations completed.
        consumed_train_samples: Training samples consumed (over all data-parallel ranks).
        skipped_train_samples: Samples of iterations whose update was skipped.
        floating_point_operations_so_far: FLOPs executed so far.
    """

    step: int
    consumed_train_samples: int
    skipped_train_samples: int
    floating_point_operations_so_far: float


@dataclass
class StepResult:
    """What one training iteration produced.

    Values stay where the step left them: losses (and, where the optimizer returns tensors,
    the gradient norm and zero count) are tensors on the training device, so reading them
    on the host (``float(...)``) waits for the device; the metrics component does that only
    when a log line or metric record needs them.

    Attributes:
        losses: Token-averaged loss per name (0-d tensors), over all micro-batches and
            data-parallel ranks; empty except on the last pipeline stage.
        skipped: The optimizer did not apply the update (non-finite or too large gradients).
        grad_norm: Gradient norm, when the optimizer computed one.
        num_zeros_in_grad: Zeros in the gradient, when counted.
        should_checkpoint: The rerun state machine asks for a checkpoint.
        should_exit: The rerun state machine stops the job: the iteration did not
            complete (the progress counters are not advanced).
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
        """Megatron's 7-tuple ``(loss_dict, skipped_iter, should_checkpoint, should_exit,
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
        train_state: The run's progress counters (advanced by :func:`run_loop`).
        model: Model chunks.
        optimizer: The optimizer.
        scheduler: The learning-rate scheduler.
        train_data_iterator: Training iterator.
        valid_data_iterator: Validation iterator, if any.
        callbacks: The loop's components and the user's callbacks.
        state: The trainer's own state object, for the user's callbacks (bridge-train:
            its ``GlobalState``); ``None`` where the loop has none. Components never read
            it: they are built with what they need.
        step_result: The latest iteration's result (``None`` before the first step).
        stop_requested: A component asked the loop to stop after this iteration.
        stop_reason: Why (the first request's reason).
        exit_code: The process exit code :func:`run_loop` returns.
    """

    train_state: TrainProgress
    model: list[Any]
    optimizer: Any
    scheduler: Any
    train_data_iterator: Any = None
    valid_data_iterator: Any = None
    callbacks: CallbackList = field(default_factory=CallbackList)
    state: Any = None
    step_result: StepResult | None = None
    stop_requested: bool = False
    stop_reason: str | None = None
    exit_code: int = 0

    @property
    def iteration(self) -> int:
        """Iterations completed so far (``train_state.step``)."""
        return int(self.train_state.step)

    @property
    def step_flops(self) -> float:
        """FLOPs of the latest completed iteration (0 before the first one)."""
        result = self.step_result
        return 0.0 if result is None or not result.completed else result.flops

    def request_stop(self, reason: str, exit_code: int = 0) -> None:
        """Ask the loop to stop after the current iteration's components have run.

        The first request names the reason; a later non-zero exit code replaces a zero one,
        so a failure is never reported as success. Every rank must take the same decision
        (a component that stops on a rank-local condition reduces it first).

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


def advance_train_state(train_state: TrainProgress, result: StepResult) -> None:
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
            advance_train_state(context.train_state, result)
        else:
            context.request_stop("the rerun state machine stopped the job", result.exit_code)
        callbacks.on_step_end(context)
    callbacks.on_train_end(context)
    return context.exit_code
