"""``progress.txt``: the run's progress appended next to its checkpoints (``log_progress``)."""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path

import torch.distributed as dist

from bridge.logging.scheduler_job import scheduler_job
from core_utils.distributed import dist_ready, global_rank, global_world_size

__all__ = ["PROGRESS_FILE", "append_progress_log"]

PROGRESS_FILE = "progress.txt"


def append_progress_log(
    save_dir: str | os.PathLike[str] | None, message: str, *, barrier: bool = True
) -> Path | None:
    """Append a timestamped line to ``<save_dir>/progress.txt`` (rank 0 writes).

    For ``LoggerConfig.log_progress``: the trainer calls it at start, at each checkpoint
    (with the tokens and floating-point operations so far) and at the end. Each line is
    ``<date time>\\tJob ID: <SLURM_JOB_ID>\\t# GPUs: <world size>\\t<message>``. The file is
    only ever appended to.

    Args:
        save_dir: Checkpoint directory (``None``: nothing is written).
        message: Text of the line.
        barrier: Wait for every rank first (a collective when torch.distributed is
            initialised), so the line follows the work it reports.

    Returns:
        The file written on rank 0, else ``None``.
    """
    if save_dir is None:
        return None
    if barrier and dist_ready():
        dist.barrier()
    if global_rank() != 0:
        return None
    path = Path(save_dir) / PROGRESS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    job_info = scheduler_job()
    job = job_info.job_id if job_info is not None else ""
    with path.open("a", encoding="utf-8") as f:
        f.write(f"{stamp}\tJob ID: {job}\t# GPUs: {global_world_size()}\t{message}\n")
    return path
