"""The evaluation component: validation every ``train.eval_interval`` iterations."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bridge.train.loop.components.maintenance import _completed
from core_utils import Timers
from core_utils.callbacks import Callback
from core_utils.loop import LoopContext

__all__ = ["EvaluateFunction", "Evaluator"]

#: Evaluates the model of ``context`` on its validation iterator and logs the result.
EvaluateFunction = Callable[[LoopContext], Any]


class Evaluator(Callback):
    """Runs validation every ``eval_interval`` iterations, between the
    ``on_validation_start`` and ``on_validation_end`` hooks.

    The iteration timer (``interval-time``) is paused around it, so evaluation does not
    count as training time. Skipped without a validation iterator.

    Args:
        evaluate: The evaluation (GPT: :class:`bridge.train.loop.eval.Evaluation`).
        eval_interval: ``train.eval_interval`` (``None`` or 0: never).
        timers: The run's timers (``None``: nothing to pause).

    Attributes:
        last_evaluated_iteration: Iteration of this loop's last validation run (``None``
            before the first one); the end of a run skips its final validation when it is
            the last iteration.
    """

    def __init__(
        self, evaluate: EvaluateFunction, eval_interval: int | None, timers: Timers | None = None
    ) -> None:
        self.evaluate = evaluate
        self.eval_interval = eval_interval
        self.timers = timers
        self.last_evaluated_iteration: int | None = None

    def on_step_end(self, context: LoopContext) -> None:
        """Evaluate on the interval."""
        if not _completed(context) or not self.eval_interval:
            return
        iteration = context.iteration
        if iteration % self.eval_interval != 0 or context.valid_data_iterator is None:
            return
        timers = self.timers
        if timers is not None:
            timers("interval-time").stop()
        context.validation(lambda: self.evaluate(context))
        self.last_evaluated_iteration = iteration
        if timers is not None:
            timers("interval-time", log_level=0).start(barrier=True)
