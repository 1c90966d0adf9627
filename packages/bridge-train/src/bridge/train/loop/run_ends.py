"""The two ends every run shares (GPT-style ``pretrain`` and the MIMO recipe alike): the
metric writers, checkpointing context and checkpoint load at the start; at the end, the
ordered release of what the run started, each step logged and never raised over an error
that may already be propagating.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bridge.config import CheckpointConfig, LoggerConfig, ModelConfigProtocol, PEFTProtocol
from bridge.logging import BackendSettings, MetricWriters, ReportSettings, build_metric_writers
from bridge.resiliency import RunResiliency
from bridge.train.checkpointing import (
    checkpoint_exists,
    finalize_async_saves,
    init_checkpointing_context,
    restore_checkpoint,
)
from bridge.train.checkpointing.context import non_persistent_dir
from bridge.train.metrics.metrics_file import JsonlMetricWriter
from bridge.train.peft.checkpoint import load_peft_checkpoints
from bridge.train.state import TrainState
from core_utils.distributed import global_rank, global_world_size

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

__all__ = [
    "TeardownStep",
    "adopt_own_save_dir",
    "build_run_metric_writers",
    "checkpointing_context_for",
    "load_run_checkpoint",
    "run_teardown",
    "run_teardown_steps",
]

logger = logging.getLogger(__name__)

#: ``(what it does, for the log line if it fails; the action)``
TeardownStep = tuple[str, Callable[[], Any]]


def build_run_metric_writers(
    logger_cfg: LoggerConfig,
    *,
    run_config: dict[str, Any] | None = None,
    metrics_file: str | Path | None = None,
    backend_settings: BackendSettings | None = None,
    report_settings: ReportSettings | None = None,
) -> MetricWriters:
    """The run's metric writers from the ``logger`` section, plus ``metrics_file`` (JSON
    lines, on the last rank) when given.

    Args:
        logger_cfg: The ``logger`` section.
        run_config: The run's config as plain data, for the backends' run parameters.
        metrics_file: Also write every metric to this JSON-lines file (last rank).
        backend_settings: MLflow / Comet settings of bridge.logging.
        report_settings: Optional reports of bridge.logging.
    """
    rank, world = global_rank(), global_world_size()
    extra = metrics_file is not None and rank == world - 1
    writers = build_metric_writers(
        logger_cfg,
        rank=rank,
        world_size=world,
        run_config=run_config,
        backend_settings=backend_settings,
        report_settings=report_settings,
        asynchronous=not extra,
    )
    if not extra:
        return writers
    assert metrics_file is not None
    return MetricWriters(
        [*writers.writers, JsonlMetricWriter(metrics_file)],
        report_settings=writers.report_settings,
        asynchronous=True,
    )


def checkpointing_context_for(checkpoint: CheckpointConfig) -> dict[str, Any]:
    """The checkpointing context of the ``checkpoint`` section (empty when the run neither
    saves nor loads; else checked, locked and ready, see ``init_checkpointing_context``)."""
    paths = (checkpoint.save, checkpoint.load, checkpoint.pretrained_checkpoint)
    if all(path is None for path in paths):
        return {}
    return init_checkpointing_context(checkpoint)


def adopt_own_save_dir(checkpoint: CheckpointConfig) -> None:
    """Resume the run that owns ``checkpoint.save`` when ``checkpoint.load`` is unset.

    torchrun restarts (and a user re-running the same command) rely on it: the save directory
    holding a checkpoint becomes ``checkpoint.load``. Which checkpoint in it is loaded is
    ``load_checkpoint``'s decision. Persistent checkpoints (tracker or complete ``iter_*``)
    count, and so do global non-persistent ones: a run killed before its first persistent
    save resumes from them.
    """
    save = checkpoint.save
    if checkpoint.load is not None or save is None:
        return
    if checkpoint_exists(save) or (
        checkpoint.non_persistent_ckpt_type == "global"
        and checkpoint_exists(non_persistent_dir(checkpoint, base=str(save)))
    ):
        checkpoint.load = save


def load_run_checkpoint(
    checkpoint: CheckpointConfig,
    train_state: TrainState,
    model: list[torch.nn.Module],
    optimizer: MegatronOptimizer | None,
    scheduler: OptimizerParamScheduler | None,
    checkpointing_context: dict[str, Any],
    *,
    reseed: Callable[[int], int] | None = None,
    model_config: ModelConfigProtocol | None = None,
    peft: PEFTProtocol | None = None,
    announce: bool = True,
) -> int:
    """Load what the ``checkpoint`` section asks for (GPT-style runs, the MIMO recipe and
    ``bridge-generate``).

    ``checkpoint.load`` left unset resumes the run that owns ``checkpoint.save`` when that
    directory holds a checkpoint (:func:`adopt_own_save_dir`; torchrun restarts rely on
    it). Which checkpoint is then loaded (``ckpt_step``, non-persistent ones,
    ``pretrained_checkpoint`` when ``load`` holds nothing, ``exit_on_missing_checkpoint``,
    damaged ones, the architecture check) is ``restore_checkpoint``'s decision; with
    ``peft`` the base weights come from ``pretrained_checkpoint`` and the adapters from the
    run's own checkpoints (``load_peft_checkpoints``).

    Args:
        checkpoint: The ``checkpoint`` section.
        train_state: The run's counters, restored in place.
        model: Model chunks.
        optimizer: The optimizer, or None (a model-only load).
        scheduler: The scheduler, or None.
        checkpointing_context: From :func:`checkpointing_context_for`.
        reseed: Called with the resumed iteration when the saved generators belong to
            another parallel layout, which they cannot be restored under; reseeds them and
            returns the base seed (``rng.seed``) for the load's warning. None: the generators
            keep this process's seeds then (as ``restore_checkpoint``'s).
        model_config: The run's model config (architecture check).
        peft: The ``peft`` section, if any.
        announce: Log "loading the checkpoint" before the load (a caller that reports the
            checkpoint itself passes False).

    Returns:
        The iteration loaded (0 when nothing was).
    """
    adopt_own_save_dir(checkpoint)
    if checkpoint.load is None and checkpoint.pretrained_checkpoint is None:
        return 0
    if announce and global_rank() == 0:  # the load takes seconds; a silent terminal looks hung
        logger.info(
            "loading the checkpoint (%s)", checkpoint.load or checkpoint.pretrained_checkpoint
        )
    load = restore_checkpoint if peft is None else load_peft_checkpoints
    iteration, flops = load(
        checkpoint,
        train_state,
        model,
        optimizer,
        scheduler,
        checkpointing_context=checkpointing_context,
        model_config=model_config,
        reseed=reseed,
    )
    train_state.step = int(iteration)
    train_state.floating_point_operations_so_far = float(flops)
    return int(iteration)


def run_teardown_steps(
    checkpoint: CheckpointConfig | None,
    resiliency: RunResiliency,
    metric_writers: MetricWriters,
    *,
    clean: bool,
    close_writers: bool = True,
) -> list[TeardownStep]:
    """The steps that release what a run started, in order.

    Pending asynchronous saves are finished first (when the run saves), then the resiliency
    objects (:meth:`bridge.resiliency.RunResiliency.teardown_steps`: fault tolerance,
    ``clean`` meaning the job ended normally so computed timeouts are stored, the straggler
    monitors, the exit-signal handler after the last save) and the metric writers.

    Args:
        checkpoint: The ``checkpoint`` section.
        resiliency: The run's resiliency objects.
        metric_writers: The run's metric writers.
        clean: The run ended normally.
        close_writers: Close the metric writers (else flush them: the run goes on, e.g. to
            its final evaluation).
    """
    steps: list[TeardownStep] = []
    if checkpoint is not None and checkpoint.save is not None:
        finalize = partial(
            finalize_async_saves, resiliency.fault_tolerance, blocking=True, terminate=True
        )
        steps.append(("finishing asynchronous checkpoint saves", finalize))
    steps += resiliency.teardown_steps(clean)
    if close_writers:
        steps.append(("closing the metric writers", metric_writers.close))
    else:
        steps.append(("flushing the metric writers", metric_writers.flush))
    return steps


def run_teardown(steps: Iterable[TeardownStep], who: str) -> None:
    """Run every step in order; a failing step is logged (``"<who>: <what> failed"``)."""
    for what, action in steps:
        try:
            action()
        except Exception:
            logger.exception("%s: %s failed", who, what)
