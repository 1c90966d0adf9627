"""The scheduler job a run belongs to: SLURM's job id, node list and requeue count.

A run requeued by SLURM (``#SBATCH --requeue``, ``scontrol requeue``) continues in a new
allocation with the same job id; ``SLURM_RESTART_COUNT`` counts the requeues (absent before
the first). The trainer records these where a user looks for them: ``progress.txt`` (the
``Job ID`` field of every line, the node list and requeue count on each ``Starting job``
line), the metric backends (``slurm/job_id`` and ``slurm/requeue_count`` at the iteration a
launch starts from) and the run parameters of W&B / MLflow / Comet (``slurm_job``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["SchedulerJob", "scheduler_job"]


@dataclass(frozen=True)
class SchedulerJob:
    """A SLURM job, as its environment describes it.

    Attributes:
        job_id: ``SLURM_JOB_ID``.
        node_list: ``SLURM_JOB_NODELIST`` (host-list syntax, e.g. ``gpu[07-08]``).
        requeue_count: ``SLURM_RESTART_COUNT`` (0 before the first requeue).
    """

    job_id: str
    node_list: str
    requeue_count: int

    def progress_fields(self) -> str:
        """``Nodes: <list>\\tRequeue count: <n>``, for a ``progress.txt`` line."""
        return f"Nodes: {self.node_list}\tRequeue count: {self.requeue_count}"

    def metrics(self) -> dict[str, float]:
        """``slurm/job_id`` (when numeric) and ``slurm/requeue_count``, for the metric backends."""
        values = {"slurm/requeue_count": float(self.requeue_count)}
        if self.job_id.isdigit():
            values["slurm/job_id"] = float(self.job_id)
        return values

    def run_parameters(self) -> dict[str, str | int]:
        """The job as run parameters (W&B config, MLflow / Comet parameters)."""
        return {
            "job_id": self.job_id,
            "node_list": self.node_list,
            "requeue_count": self.requeue_count,
        }


def scheduler_job(environ: Mapping[str, str] | None = None) -> SchedulerJob | None:
    """The SLURM job this process runs in, or ``None`` outside SLURM.

    Args:
        environ: The process environment (default ``os.environ``).

    Returns:
        The job (a malformed ``SLURM_RESTART_COUNT`` counts as 0), or ``None`` when
        ``SLURM_JOB_ID`` is not set.
    """
    environ = os.environ if environ is None else environ
    job_id = environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    restarts = environ.get("SLURM_RESTART_COUNT", "0")
    return SchedulerJob(
        job_id=job_id,
        node_list=environ.get("SLURM_JOB_NODELIST", ""),
        requeue_count=int(restarts) if restarts.isdigit() else 0,
    )
