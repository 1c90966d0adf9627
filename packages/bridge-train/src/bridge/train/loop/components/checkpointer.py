"""The checkpointer component: every save decision of the loop, one pluggable writer.

:class:`Checkpointer` decides when to save (``checkpoint.save_interval``,
``checkpoint.non_persistent_save_interval``, a rerun-state-machine request, an exit
condition of :class:`bridge.resiliency.ExitConditions` (signal, duration,
``train.exit_interval``, a stop request), and a final save when the loop ends), commits
finished asynchronous saves without blocking after every step and waits for them at the
end. How a checkpoint is written is not its business: it calls a :data:`SaveFunction`
(GPT training and the MIMO recipe: :class:`bridge.train.loop.saving.CheckpointWriter`)
and, for asynchronous saves, a :data:`FinalizeFunction`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from bridge.config import CheckpointConfig
from bridge.train.checkpointing import finalize_async_saves, pending_async_saves
from core_utils.callbacks import Callback
from core_utils.distributed import global_rank
from core_utils.loop import LoopContext

if TYPE_CHECKING:
    from bridge.resiliency import ExitConditions, ExitDecision, FaultTolerance

__all__ = ["Checkpointer", "FinalizeFunction", "SaveFunction"]

#: Writes a checkpoint of ``context`` at ``context.iteration``: ``(context, non_persistent)``.
#: A collective; for an asynchronous save it returns once the background write is queued.
SaveFunction = Callable[["LoopContext", bool], None]

#: Commits finished asynchronous saves: ``(context, blocking) -> number committed``.
#: ``blocking=True`` (at the end of training) waits for every pending save. A collective.
FinalizeFunction = Callable[["LoopContext", bool], int]


class Checkpointer(Callback):
    """Owns every save decision of the loop (see the module docstring).

    Fires ``on_save`` of the loop's callbacks after each checkpoint is written (for an
    asynchronous save: once it is committed).

    Args:
        save: Writes one checkpoint (``None``: a run without a ``checkpoint`` section).
        checkpoint_config: The run's ``checkpoint`` section (``None``: never save).
        exit_conditions: Signal / duration / interval / stop-request exit conditions
            (``None``: only the run's length ends the loop).
        finalize: Commits finished asynchronous saves (``None``: saves are synchronous).

    Attributes:
        last_saved_iteration: Iteration of the last persistent checkpoint saved by this
            loop (``None`` before the first one); the end of training saves one unless it
            is the final iteration.
    """

    def __init__(
        self,
        save: SaveFunction | None,
        checkpoint_config: CheckpointConfig | None,
        exit_conditions: ExitConditions | None = None,
        finalize: FinalizeFunction | None = None,
    ) -> None:
        self.save_function = save
        self.finalize_function = finalize
        self.exit_conditions = exit_conditions
        config = checkpoint_config
        self.enabled = config is not None and config.save is not None
        self.save_interval = None if config is None else config.save_interval
        self.non_persistent_save_interval = (
            None if config is None else config.non_persistent_save_interval
        )
        self.last_saved_iteration: int | None = None

    @classmethod
    def from_config(
        cls,
        checkpoint: CheckpointConfig | None,
        save: SaveFunction | None,
        *,
        exit_conditions: ExitConditions | None = None,
        fault_tolerance: FaultTolerance | None = None,
    ) -> Checkpointer:
        """The checkpointer of the ``checkpoint`` section: with ``checkpoint.async_save``,
        finished asynchronous saves are committed by bridge-train's checkpointing (a
        fault-tolerance checkpointing section).

        Args:
            checkpoint: The ``checkpoint`` section (``None``: never save).
            save: Writes one checkpoint (``None``: never saves).
            exit_conditions: The run's exit conditions.
            fault_tolerance: The run's fault-tolerance hooks (for finalizing saves).
        """

        def finalize(context: LoopContext, blocking: bool) -> int:
            before = pending_async_saves()
            finalize_async_saves(fault_tolerance, blocking=blocking, terminate=blocking)
            return before - pending_async_saves()

        async_saves = checkpoint is not None and bool(checkpoint.save) and checkpoint.async_save
        return cls(
            save,
            checkpoint,
            exit_conditions=exit_conditions,
            finalize=finalize if async_saves else None,
        )

    def save(self, context: LoopContext, *, non_persistent: bool = False) -> None:
        """Write a checkpoint of this iteration now (a collective).

        Args:
            context: The loop's context.
            non_persistent: A non-persistent (local) checkpoint.
        """
        assert self.save_function is not None, "no checkpoint section: nothing saves"
        self.save_function(context, non_persistent)
        if not non_persistent:
            self.last_saved_iteration = context.iteration
        if self.finalize_function is None:
            context.saved()

    def finalize(self, context: LoopContext, *, blocking: bool) -> None:
        """Commit finished asynchronous saves (all pending ones when ``blocking``)."""
        if self.finalize_function is None:
            return
        for _ in range(self.finalize_function(context, blocking)):
            context.saved()

    def save_and_decide(self, context: LoopContext) -> ExitDecision | None:
        """Save on the intervals, then ask the exit conditions (saving once more if they say).

        A persistent checkpoint every ``save_interval`` iterations, else a non-persistent
        one every ``non_persistent_save_interval``; an exit that needs a checkpoint saves
        exactly one (none if this iteration was just saved); rank 0 prints why it exits.
        Collective: every rank agrees on the decision.

        Returns:
            The exit decision, or ``None`` without exit conditions.
        """
        iteration = context.iteration
        interval, non_persistent_interval = self.save_interval, self.non_persistent_save_interval
        persistent = bool(self.enabled and interval and iteration % interval == 0)
        saved = persistent or bool(
            non_persistent_interval and iteration % non_persistent_interval == 0
        )
        if saved:
            self.save(context, non_persistent=not persistent)
        if self.exit_conditions is None:
            return None
        decision = self.exit_conditions.check(iteration, saved_this_iteration=saved)
        if decision.should_save and self.enabled:
            self.save(context)
        if decision.should_exit and global_rank() == 0:
            print(f"[bridge-train] {decision.message}", flush=True)
        return decision

    def on_step_end(self, context: LoopContext) -> None:
        """Save when asked to; stop the loop when an exit condition holds."""
        result = context.step_result
        assert result is not None
        if result.should_checkpoint and self.enabled:
            self.save(context)
        if not result.completed:
            return
        self.finalize(context, blocking=False)
        decision = self.save_and_decide(context)
        if decision is not None and decision.should_exit:
            context.request_stop(decision.message, decision.exit_code)

    def on_train_end(self, context: LoopContext) -> None:
        """Save the last iteration unless it was saved or the job failed; commit every save."""
        if (
            context.exit_code == 0
            and self.enabled
            and context.iteration > 0
            and self.last_saved_iteration != context.iteration
        ):
            self.save(context)
        self.finalize(context, blocking=True)
