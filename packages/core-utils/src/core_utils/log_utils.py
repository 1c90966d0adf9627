"""Logging on selected ranks of a distributed job."""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from core_utils._megatron import initialized_parallel_state
from core_utils.distributed import dist_ready

__all__ = ["log_on_each_pipeline_stage", "log_single_rank", "logger"]

logger = logging.getLogger("core_utils")


def log_single_rank(logger: logging.Logger, *args: Any, rank: int = 0, **kwargs: Any) -> None:
    """Log on one rank only (on the single process when torch.distributed is not initialised).

    Args:
        logger: The logger to write to.
        *args: Positional arguments of :meth:`logging.Logger.log` (level, msg, ...).
        rank: Global rank that writes the record.
        **kwargs: Keyword arguments of :meth:`logging.Logger.log`.
    """
    if not dist_ready() or dist.get_rank() == rank:
        logger.log(*args, **kwargs)


def log_on_each_pipeline_stage(
    logger: logging.Logger,
    *args: Any,
    tp_group: dist.ProcessGroup | None = None,
    dp_cp_group: dist.ProcessGroup | None = None,
    **kwargs: Any,
) -> None:
    """Log on the first rank of each pipeline stage (tensor- and data/context-parallel rank 0).

    Args:
        logger: The logger to write to.
        *args: Positional arguments of :meth:`logging.Logger.log`.
        tp_group: Tensor-parallel group of this rank; give it together with ``dp_cp_group``.
        dp_cp_group: Data-parallel (with context-parallel) group of this rank.
        **kwargs: Keyword arguments of :meth:`logging.Logger.log`.

    Without groups, megatron's ``parallel_state`` supplies them when it is initialised; a
    job without torch.distributed is one stage of one rank and always logs.

    Raises:
        ValueError: Only one of ``tp_group`` / ``dp_cp_group`` was given, or neither was
            given while torch.distributed runs without megatron's parallel_state.
    """
    if (tp_group is None) != (dp_cp_group is None):
        raise ValueError(
            "log_on_each_pipeline_stage: pass tp_group and dp_cp_group together, or neither "
            f"(got tp_group={tp_group!r}, dp_cp_group={dp_cp_group!r})"
        )
    if tp_group is not None and dp_cp_group is not None:
        tp_rank, dp_cp_rank = tp_group.rank(), dp_cp_group.rank()
    elif not dist_ready():
        tp_rank = dp_cp_rank = 0
    else:
        parallel_state = initialized_parallel_state()
        if parallel_state is None:
            raise ValueError(
                "log_on_each_pipeline_stage: torch.distributed is initialised but megatron's "
                "parallel_state is not; pass tp_group= and dp_cp_group="
            )
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        dp_cp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    if tp_rank == 0 and dp_cp_rank == 0:
        logger.log(*args, **kwargs)
