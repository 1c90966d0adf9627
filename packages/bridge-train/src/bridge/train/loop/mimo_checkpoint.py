"""Checkpoints of the ``mimo`` recipe: bridge-train's own checkpoint functions on a MIMO run.

A MIMO checkpoint is an ordinary bridge-train checkpoint (``docs/checkpoints.md``): the same
:func:`~bridge.train.checkpointing.write_checkpoint` / ``restore_checkpoint`` write and read
it, so it is committed only when complete (staging directory, completion marker with XXH3-64
checksums, tracker written last), the save directory is locked, and damaged or absent
checkpoints are handled exactly as for GPT. What is MIMO-specific is small:

* the model is one chunk, :class:`MimoCheckpointModel`, whose sharded state dict is
  megatron-core ``MimoModel.sharded_state_dict``: every module's tensors on the ranks of its
  own grid, tensor-parallel shards with their offsets and data-parallel copies with their
  replica ids, so dist_checkpointing reshards them under another MIMO layout;
* the optimizer is bridge.mimo's ``MultiModuleOptimizer``, whose per-parameter state follows
  its parameter's sharding (it reshards with the model);
* the layout recorded with the checkpoint names every module's ranks, TP and DP, so RNG
  state (per rank) is restored only under the same layout; when any module's layout
  changed, the generators are reseeded from ``rng.seed`` and the resumed iteration (as
  ``pretrain`` does for GPT), and the load's one warning names both layouts and says so;
* the data position is the train state's ``consumed_train_samples``, which the MIMO loader
  resumes from (the same order, neither restarted nor replayed).

The save decisions (``checkpoint.save_interval``, ``non_persistent_save_interval``, an
early exit: exit signal, duration, ``train.exit_interval``; the end of training; committing
asynchronous saves) are the shared loop's :class:`~bridge.train.loop.components.Checkpointer`,
as for GPT, and the writer it is given is GPT's too
(:class:`~bridge.train.loop.saving.CheckpointWriter`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from bridge.config import CheckpointConfig
from bridge.train.checkpointing import restore_checkpoint
from bridge.train.engine.initialize import resume_seed, seed_process_generators
from bridge.train.loop.run_ends import adopt_own_save_dir
from bridge.train.models.mimo import MimoModelConfig
from bridge.train.state import TrainState

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

__all__ = [
    "MimoCheckpointModel",
    "describe_mimo_layout",
    "load_mimo_checkpoint",
]


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


def load_mimo_checkpoint(
    checkpoint: CheckpointConfig,
    train_state: TrainState,
    chunk: MimoCheckpointModel,
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    checkpointing_context: dict[str, Any],
    *,
    rng_seed: int,
    model_config: MimoModelConfig | None = None,
) -> int:
    """Load what ``checkpoint.load`` names, or resume the run owning ``checkpoint.save``.

    Everything else (which checkpoint, ``ckpt_step``, damaged or absent checkpoints,
    ``finetune``, ``load_optim``, ``load_rng``, the architecture check) is
    :func:`~bridge.train.checkpointing.restore_checkpoint`'s, exactly as for GPT.

    Args:
        checkpoint: The ``checkpoint`` section.
        train_state: The run's counters (restored in place; ``consumed_train_samples`` is
            the data position).
        chunk: The MIMO model.
        optimizer: The multi-module optimizer.
        scheduler: The scheduler.
        checkpointing_context: From ``init_checkpointing_context``.
        rng_seed: ``rng.seed``: after a resume under another layout (any module's ranks,
            TP or DP), whose saved per-rank generator states belong to other ranks, every
            generator is reseeded from it and the resumed iteration
            (:func:`~bridge.train.engine.initialize.resume_seed`).
        model_config: The run's model config (architecture check).

    Returns:
        The iteration to continue from (0 when nothing was loaded).
    """
    adopt_own_save_dir(checkpoint)
    if checkpoint.load is None and checkpoint.pretrained_checkpoint is None:
        return 0

    def reseed(iteration: int) -> int:
        # The saved generators are other ranks' (another module layout): reseed from (seed,
        # iteration), reproducibly, rather than keep the fresh start's streams, which a
        # resume would then replay from their first draw on.
        seed_process_generators(resume_seed(rng_seed, iteration))
        return rng_seed

    iteration, _ = restore_checkpoint(
        checkpoint,
        train_state,
        [chunk],
        optimizer,
        scheduler,
        model_config=model_config,
        checkpointing_context=checkpointing_context,
        reseed=reseed,
    )
    return iteration
