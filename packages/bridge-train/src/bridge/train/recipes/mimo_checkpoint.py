"""Checkpoints of the ``mimo`` recipe: bridge-train's own checkpoint functions on a MIMO run.

A MIMO checkpoint is an ordinary bridge-train checkpoint (``docs/checkpoints.md``): the same
:func:`~bridge.train.checkpointing.save_checkpoint` / ``load_checkpoint`` write and read
it, so it is committed only when complete (staging directory, completion marker with CRC-32
checksums, tracker written last), the save directory is locked, and damaged or absent
checkpoints are handled exactly as for GPT. What is MIMO-specific is small:

* the model is one chunk, :class:`MimoCheckpointModel`, whose sharded state dict is
  megatron-core ``MimoModel.sharded_state_dict``: every module's tensors on the ranks of its
  own grid, tensor-parallel shards with their offsets and data-parallel copies with their
  replica ids, so dist_checkpointing reshards them under another MIMO layout;
* the optimizer is bridge.mimo's ``MultiModuleOptimizer``, whose per-parameter state follows
  its parameter's sharding (it reshards with the model);
* the layout recorded with the checkpoint names every module's ranks, TP and DP, so RNG
  state (per rank) is restored only under the same layout;
* the data position is the train state's ``consumed_train_samples``, which the MIMO loader
  resumes from (the same order, neither restarted nor replayed).

:class:`MimoCheckpointer` is the loop component (a ``core_utils.Callback`` for
``bridge.mimo.train_mimo``) that owns the save decisions: ``checkpoint.save_interval``,
``checkpoint.non_persistent_save_interval``, an early exit (exit signal, duration, interval:
one save, then stop) and the end of training, and the commit of asynchronous saves.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from bridge.config import CheckpointConfig
from bridge.train.state import GlobalState
from core_utils.callbacks import Callback

__all__ = ["MimoCheckpointModel", "MimoCheckpointer", "describe_mimo_layout"]

logger = logging.getLogger(__name__)


def describe_mimo_layout(layout: Any) -> dict[str, str]:
    """Module name -> ``"ranks 0-1 TP1 DP2"``: what a checkpoint records of a MIMO layout."""
    described: dict[str, str] = {}
    for name, placement in layout.modules.items():
        ranks = placement.rank_range
        span = f"rank {ranks.start}" if len(ranks) == 1 else f"ranks {ranks.start}-{ranks[-1]}"
        described[name] = f"{span} TP{placement.tp} DP{placement.dp_size}"
    return described


class MimoCheckpointModel(torch.nn.Module):
    """The model chunk bridge-train's checkpoint functions see for a MIMO model.

    Args:
        model: The (possibly wrapped) megatron-core ``MimoModel`` of this rank.
        layout: The ``bridge.mimo.MimoLayout`` it was built for.
    """

    def __init__(self, model: torch.nn.Module, layout: Any) -> None:
        super().__init__()
        self.module = model
        self._layout = layout

    def sharded_state_dict(
        self,
        prefix: str = "",
        sharded_offsets: tuple[tuple[int, int, int], ...] = (),
        metadata: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """megatron-core's ``MimoModel.sharded_state_dict`` (this rank's modules only)."""
        return self.module.sharded_state_dict(prefix, sharded_offsets, metadata)  # type: ignore[operator]

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load into the MIMO model (keys as :meth:`sharded_state_dict` names them)."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def checkpoint_parallel_layout(self) -> dict[str, Any]:
        """The MIMO layout, recorded in the checkpoint and compared on load."""
        return {"mimo_layout": describe_mimo_layout(self._layout)}


class MimoCheckpointer(Callback):
    """Loads the run's checkpoint and owns every save decision of a MIMO run.

    Args:
        state: The run's state (``cfg`` with the checkpoint and train sections,
            ``train_state``, ``exit_conditions``).
        chunk: The model as :class:`MimoCheckpointModel`.
        optimizer: The ``MultiModuleOptimizer``.
        scheduler: The learning-rate scheduler, or None.
        context: From ``init_checkpointing_context``.
    """

    def __init__(
        self,
        state: GlobalState,
        chunk: MimoCheckpointModel,
        optimizer: Any,
        scheduler: Any,
        context: dict[str, Any],
    ) -> None:
        self.state = state
        self.chunk = chunk
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.context = context
        checkpoint = state.cfg.checkpoint
        assert checkpoint is not None
        self.checkpoint: CheckpointConfig = checkpoint

    @property
    def _saves(self) -> bool:
        return self.checkpoint.save is not None

    def load(self) -> int:
        """Load what ``checkpoint.load`` (or a save directory holding a checkpoint) names.

        Returns:
            The iteration to continue from (0 when nothing was loaded).
        """
        from bridge.train.checkpointing import checkpoint_exists, load_checkpoint

        checkpoint = self.checkpoint
        if checkpoint.load is None and checkpoint_exists(checkpoint.save):
            # The run owning the save directory resumes (torchrun restarts rely on it).
            checkpoint.load = checkpoint.save
        if checkpoint.load is None and checkpoint.pretrained_checkpoint is None:
            return 0
        iteration, _ = load_checkpoint(
            self.state,
            [self.chunk],
            self.optimizer,
            self.scheduler,
            checkpointing_context=self.context,
        )
        self.state.loaded_iteration = iteration
        self.state.job_start_flops = self.state.train_state.floating_point_operations_so_far
        return iteration

    def _save(self, *, non_persistent: bool = False) -> None:
        from bridge.train.checkpointing import save_checkpoint

        save_checkpoint(
            self.state,
            [self.chunk],
            self.optimizer,
            self.scheduler,
            self.state.train_state.floating_point_operations_so_far,
            self.context,
            non_persistent_ckpt=non_persistent,
        )
        if not non_persistent:
            self.state.last_saved_iteration = self.state.train_state.step

    def _advance(self, context: Any) -> None:
        train_state = self.state.train_state
        train_state.step = context.iteration
        train_state.consumed_train_samples = context.consumed_samples
        outcome = context.outcome
        if outcome is not None:
            if not outcome.update_successful:
                train_state.skipped_train_samples += context.data.global_batch_size
            train_state.floating_point_operations_so_far += sum(outcome.flops.values())

    def on_step_end(self, context: Any) -> None:
        """Count the step, commit finished async saves, save on interval or exit."""
        self._advance(context)
        iteration = context.iteration
        checkpoint = self.checkpoint
        if self._saves and checkpoint.async_save:
            from bridge.train.checkpointing import finalize_async_saves

            finalize_async_saves(self.state)
        saved = False
        if self._saves and checkpoint.save_interval and iteration % checkpoint.save_interval == 0:
            self._save()
            saved = True
        elif (
            checkpoint.non_persistent_ckpt_type == "global"
            and checkpoint.non_persistent_save_interval
            and iteration % checkpoint.non_persistent_save_interval == 0
        ):
            self._save(non_persistent=True)
        exits = self.state.exit_conditions
        if exits is None:
            return
        decision = exits.check(iteration, saved_this_iteration=saved)
        if decision.should_save:
            self._save()
        if decision.should_exit:
            context.request_stop(decision.message)

    def on_train_end(self, context: Any) -> None:
        """Save the final iteration (unless just saved) and commit every pending save."""
        if self._saves and context.iteration > 0:
            already = (self.state.last_saved_iteration, self.state.loaded_iteration)
            if context.iteration not in already:
                self._save()
        self.close()

    def close(self) -> None:
        """Wait for and commit pending asynchronous saves, stop the writer (idempotent)."""
        if self._saves and self.checkpoint.async_save:
            from bridge.train.checkpointing import finalize_async_saves

            finalize_async_saves(self.state, blocking=True, terminate=True)
