"""``progress.txt``: one line per launch and per saved checkpoint, with throughput.

With ``logger.log_progress`` and ``checkpoint.save`` set, the trainer appends to
``<checkpoint.save>/progress.txt`` (through :func:`bridge.logging.append_progress_log`,
which writes ``<date time>\\tJob ID: <id>\\t# GPUs: <world size>\\t<message>`` on rank 0):

* ``Starting job`` when a launch begins training (under SLURM followed by
  ``Nodes: <node list>\tRequeue count: <n>``, see :mod:`bridge.logging.scheduler_job`);
* after each persistent checkpoint::

    Saved checkpoint\\tIteration: 40\\tJob throughput: 0.0123 TFLOP/s/GPU\\t
    Cumulative throughput: 0.0119 TFLOP/s/GPU\\tFloating-point operations: 1.23e+12\\t
    Tokens (in billions): 0.000164

The job throughput is this launch's FLOPs (the FLOP counter minus its value when the launch
started training, after loading a checkpoint) over this launch's wall-clock time, per rank.
The cumulative throughput covers every launch with the same world size since the earliest
one that follows a launch of a different size: FLOPs since that launch started over the time
since then (restarts and queueing included), per rank.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from bridge.config import CheckpointConfig, ConfigContainer
from bridge.logging import MetricWriters, append_progress_log, scheduler_job
from bridge.logging.progress_log import PROGRESS_FILE
from core_utils.distributed import global_world_size
from core_utils.loop import TrainProgress

if TYPE_CHECKING:
    from bridge.train.state import GlobalState

__all__ = [
    "PROGRESS_FILE",
    "ProgressLog",
    "compute_throughputs_and_append_to_progress_log",
    "get_start_time_from_progress_log",
    "record_starting_job",
]

STARTING_JOB = "Starting job"
SAVED_CHECKPOINT = "Saved checkpoint"
SAVING_ASYNC_CHECKPOINT = "Saving async checkpoint"
_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


def _fields(line: str) -> tuple[datetime, int, str, dict[str, str]] | None:
    """``(time, world size, kind, {name: value})`` of a progress line, or None if malformed
    (a line cut by a launch killed mid-write: its time or a number unreadable)."""
    parts = line.rstrip("\n").split("\t")
    if len(parts) < 4 or not parts[2].startswith("# GPUs:"):
        return None
    try:
        stamp = datetime.strptime(parts[0], _TIME_FORMAT)
        world = int(parts[2].split(":", 1)[1])
    except ValueError:
        return None
    pairs = (part.split(":", 1) for part in parts[4:] if ":" in part)
    return stamp, world, parts[3], {name.strip(): value.strip() for name, value in pairs}


def get_start_time_from_progress_log(cfg: ConfigContainer) -> tuple[datetime, float]:
    """Gets start time of earliest job with same world size. Also returns the number of
    floating-point operations completed in last saved checkpoint.

    The earliest job is the first ``Starting job`` line of the most recent run of lines
    with this world size (a launch with another world size restarts the search). The
    FLOPs are those of the last checkpoint saved before that job started, so the
    cumulative throughput counts only work done by jobs of this world size.

    Args:
        cfg: The config (``checkpoint.save`` locates ``progress.txt``).

    Returns:
        ``(start time of that job, FLOPs already done when it started)``.

    Raises:
        ValueError: ``checkpoint.save`` is not set.
        FileNotFoundError: There is no ``progress.txt``.
        RuntimeError: No ``Starting job`` line with this world size exists.
    """
    save = cfg.checkpoint.save if cfg.checkpoint is not None else None
    if save is None:
        raise ValueError("get_start_time_from_progress_log: checkpoint.save is not set")
    return _earliest_job(save)


def _earliest_job(save: str | os.PathLike[str]) -> tuple[datetime, float]:
    """:func:`get_start_time_from_progress_log` of the run saving to ``save``."""
    path = Path(save) / PROGRESS_FILE
    world = global_world_size(launcher_fallback=True)
    start: tuple[datetime, float] | None = None  # the earliest job's (time, FLOPs before it)
    latest_flops = 0.0
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            parsed = _fields(line)
            if parsed is None:
                continue
            stamp, line_world, kind, values = parsed
            if kind in (SAVED_CHECKPOINT, SAVING_ASYNC_CHECKPOINT):
                raw = values.get("Floating-point operations")
                if raw is not None:
                    try:
                        latest_flops = float(raw)
                    except ValueError:  # cut mid-write: the line is malformed
                        continue
            if line_world != world:
                start = None
                continue
            if kind == STARTING_JOB and start is None:
                start = stamp, latest_flops
    if start is None:
        raise RuntimeError(
            f"{path} has no 'Starting job' line for world size {world}; the trainer writes "
            "one at the start of every launch with logger.log_progress"
        )
    return start


def _tflops_per_device(flops: float, seconds: float, world: int) -> float:
    return flops / max(seconds, 1e-9) / 1e12 / world


@dataclass
class ProgressLog:
    """``progress.txt`` of one launch (see the module docstring).

    Attributes:
        save: ``checkpoint.save`` (the file is ``<save>/progress.txt``).
        async_save: ``checkpoint.async_save`` (names the checkpoint lines).
        seq_length: Tokens per sample (0 when unknown).
        start_time: ``time.time()`` when this launch started.
        job_start_flops: The FLOP counter when this launch started training.
    """

    save: str
    async_save: bool = False
    seq_length: int = 0
    start_time: float = field(default_factory=time.time)
    job_start_flops: float = 0.0

    @classmethod
    def in_save_dir(
        cls,
        checkpoint: CheckpointConfig | None,
        *,
        seq_length: int,
        start_time: float,
        job_start_flops: float,
    ) -> ProgressLog | None:
        """The progress log of ``checkpoint.save`` (``None``: no save directory to write in)."""
        if checkpoint is None or not checkpoint.save:
            return None
        save, async_save = str(checkpoint.save), bool(checkpoint.async_save)
        return cls(save, async_save, seq_length, start_time, job_start_flops)

    def saved_checkpoint(self, train_state: TrainProgress, flops_so_far: float) -> None:
        """Append the line of a persistent checkpoint just saved (a collective).

        Args:
            train_state: The run's counters (``step``, ``consumed_train_samples``).
            flops_so_far: Total floating-point operations completed.
        """
        world = global_world_size(launcher_fallback=True)
        job_flops = flops_so_far - self.job_start_flops
        job_throughput = _tflops_per_device(job_flops, time.time() - self.start_time, world)
        try:
            first_start, first_flops = _earliest_job(self.save)
        except (FileNotFoundError, RuntimeError):
            # No "Starting job" line of this world size (log_progress was switched on now):
            # this job is the earliest one known.
            first_start = datetime.fromtimestamp(self.start_time)
            first_flops = self.job_start_flops
        elapsed = (datetime.now() - first_start).total_seconds()
        cumulative = _tflops_per_device(flops_so_far - first_flops, elapsed, world)
        tokens = train_state.consumed_train_samples * self.seq_length
        kind = SAVING_ASYNC_CHECKPOINT if self.async_save else SAVED_CHECKPOINT
        append_progress_log(
            self.save,
            f"{kind}\tIteration: {train_state.step}\t"
            f"Job throughput: {job_throughput:.6g} TFLOP/s/GPU\t"
            f"Cumulative throughput: {cumulative:.6g} TFLOP/s/GPU\t"
            f"Floating-point operations: {flops_so_far:.6e}\t"
            f"Tokens (in billions): {tokens / 1e9:.6g}",
        )


def compute_throughputs_and_append_to_progress_log(
    state: GlobalState, num_floating_point_operations_so_far: float
) -> None:
    """Computes job and cumulative throughputs and appends to progress log.

    Calculates TFLOP/s/GPU based on floating-point operations and elapsed time. Appends the
    computed throughputs, total FLOPs, and processed tokens to the progress log file. A
    collective (a barrier before rank 0 writes): call it on every rank. Does nothing when
    ``checkpoint.save`` is not set.

    Args:
        state: The GlobalState object (``cfg``, ``train_state``, ``start_time`` and
            ``job_start_flops`` are read).
        num_floating_point_operations_so_far: Total floating-point operations completed.
    """
    cfg = state.cfg
    progress_log = ProgressLog.in_save_dir(
        cfg.checkpoint,
        seq_length=int(getattr(cfg.model, "seq_length", 0) or 0),
        start_time=state.start_time,
        job_start_flops=state.job_start_flops,
    )
    if progress_log is not None:
        progress_log.saved_checkpoint(state.train_state, num_floating_point_operations_so_far)


def record_starting_job(
    progress_log: ProgressLog | None, metric_writers: MetricWriters, iteration: int
) -> None:
    """Record the start of a launch (call on every rank when a launch starts training).

    Under SLURM the metric writers get ``slurm/job_id`` and ``slurm/requeue_count`` at the
    iteration the launch starts from. With a progress log (``logger.log_progress`` and
    ``checkpoint.save``), ``Starting job`` is appended to ``progress.txt`` (under SLURM with
    the node list and the requeue count).

    Args:
        progress_log: The run's ``progress.txt``, if kept.
        metric_writers: The run's metric writers.
        iteration: The iteration the launch starts from.
    """
    job = scheduler_job()
    if job is not None:
        metric_writers.log_metrics(job.metrics(), iteration)
    if progress_log is not None:
        details = "" if job is None else f"\t{job.progress_fields()}"
        append_progress_log(progress_log.save, f"{STARTING_JOB}{details}")
