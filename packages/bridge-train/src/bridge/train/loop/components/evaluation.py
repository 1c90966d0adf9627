"""The evaluation component: validation every ``train.eval_interval`` iterations."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from core_utils.callbacks import Callback

if TYPE_CHECKING:
    from bridge.train.loop.run_loop import LoopContext

__all__ = ["EvaluateFunction", "Evaluator"]

#: Evaluates the model of ``context`` on its validation iterator and logs the result.
EvaluateFunction = Callable[["LoopContext"], Any]


class Evaluator(Callback):
    """Runs validation every ``eval_interval`` iterations, between the
    ``on_validation_start`` and ``on_validation_end`` hooks.

    The iteration timer (``interval-time``) is paused around it, so evaluation does not
    count as training time. Skipped without a validation iterator or when the run has no
    validation split (``train_state.do_valid``).

    Args:
        evaluate: The evaluation (GPT: ``evaluate_and_print_results``; MIMO its own).
        eval_interval: ``train.eval_interval`` (``None`` or 0: never).
    """

    def __init__(self, evaluate: EvaluateFunction, eval_interval: int | None) -> None:
        self.evaluate = evaluate
        self.eval_interval = eval_interval

    def on_step_end(self, context: LoopContext) -> None:
        """Evaluate on the interval."""
        result = context.step_result
        if result is None or not result.completed or not self.eval_interval:
            return
        state = context.state
        iteration = context.iteration
        if (
            iteration % self.eval_interval != 0
            or not state.train_state.do_valid
            or context.valid_data_iterator is None
        ):
            return
        timers = state.timers
        timers("interval-time").stop()
        context.validation(lambda: self.evaluate(context))
        state.last_evaluated_iteration = iteration
        timers("interval-time", log_level=0).start(barrier=True)
