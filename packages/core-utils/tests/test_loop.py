"""The stack's one training loop (``core_utils.loop``) with counters of one's own.

bridge-train's tests run it with the trainer's state and components; these check the
driver's contract with nothing but a plain dataclass of counters (what bridge.mimo and the
resiliency drills pass).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from core_utils.callbacks import Callback, CallbackList
from core_utils.loop import LoopContext, StepResult, TrainProgress, advance_train_state, run_loop


@dataclass
class Progress:
    step: int = 0
    consumed_train_samples: int = 0
    skipped_train_samples: int = 0
    floating_point_operations_so_far: float = 0.0


class Hooks(Callback):
    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_train_start(self, context: LoopContext) -> None:
        self.seen.append(f"start@{context.iteration}")

    def on_step_start(self, context: LoopContext) -> None:
        self.seen.append(f"step_start@{context.iteration}")

    def on_step_end(self, context: LoopContext) -> None:
        self.seen.append(f"step_end@{context.iteration}")

    def on_train_end(self, context: LoopContext) -> None:
        self.seen.append(f"end@{context.iteration}")


def _context(progress: TrainProgress, *callbacks: Callback) -> LoopContext:
    return LoopContext(progress, [], None, None, callbacks=CallbackList(callbacks))


def test_counters_of_one_s_own_advance_with_each_completed_step() -> None:
    progress = Progress(step=5, consumed_train_samples=40)
    results = iter([StepResult(num_samples=8, flops=2.0), StepResult(num_samples=8, skipped=True)])
    context = _context(progress)
    assert run_loop(context, lambda c: next(results), lambda c: c.iteration >= 7) == 0
    assert progress == Progress(7, 56, 8, 2.0)
    assert context.iteration == 7 and context.step_flops == 0.0  # the last step: no FLOPs
    assert context.state is None  # no trainer state: components never need one
    advance_train_state(progress, StepResult(num_samples=1, flops=0.5))
    assert (progress.step, progress.floating_point_operations_so_far) == (8, 2.5)


def test_a_run_already_done_takes_no_step_and_a_stop_ends_after_the_step() -> None:
    hooks = Hooks()
    context = _context(Progress(step=3), hooks)
    run_loop(context, lambda c: pytest.fail("no step"), lambda c: c.iteration >= 3)
    assert hooks.seen == ["start@3", "end@3"]

    class StopAtStepStart(Callback):
        def on_step_start(self, context: LoopContext) -> None:
            context.request_stop("now")

    hooks = Hooks()
    context = _context(Progress(), StopAtStepStart(), hooks)
    run_loop(context, lambda c: StepResult(losses={"x": torch.ones(())}), lambda c: False)
    # The iteration that was asked to stop still completes and is seen by every hook.
    assert hooks.seen == ["start@0", "step_start@0", "step_end@1", "end@1"]
    assert context.stop_reason == "now" and context.exit_code == 0


def test_an_error_in_the_step_skips_on_train_end() -> None:
    hooks = Hooks()
    context = _context(Progress(), hooks)

    def broken(context: LoopContext) -> StepResult:
        raise RuntimeError("step failed")

    with pytest.raises(RuntimeError, match="step failed"):
        run_loop(context, broken, lambda c: False)
    assert hooks.seen == ["start@0", "step_start@0"]  # the caller's cleanup runs instead
