"""CUDA memory reports, their reduction across pipeline stages, and allocator history."""

from __future__ import annotations

import math
import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bridge.config import ProfilingConfig
from bridge.logging._notices import logger, notice_once
from core_utils.distributed import collective_device, dist_ready, global_rank
from core_utils.process_groups import get_pg_size

__all__ = [
    "MEMORY_KEYS",
    "format_memory_stats",
    "maybe_dump_memory_snapshot",
    "reduce_max_memory_across_pp_group",
    "report_memory",
    "start_memory_history_recording",
]

MEMORY_KEYS: dict[str, str] = {
    "allocated_bytes.all.current": "current_allocated_mem",
    "active_bytes.all.current": "current_active_mem",
    "inactive_split_bytes.all.current": "current_inactive_mem",
    "reserved_bytes.all.current": "current_reserved_mem",
    "allocated_bytes.all.peak": "peak_allocated_mem",
    "active_bytes.all.peak": "peak_active_mem",
    "inactive_split_bytes.all.peak": "peak_inactive_mem",
    "reserved_bytes.all.peak": "peak_reserved_mem",
    "num_alloc_retries": "alloc_retries",
}
"""``torch.cuda.memory_stats()`` key -> reported name. Byte counts are reported in
gigabytes (10^9 bytes); ``alloc_retries`` (failed cudaMalloc calls that flushed the cache
and retried) stays an integer count."""


def _gigabytes(num_bytes: float) -> float:
    """Bytes as gigabytes, rounded to 5 significant digits."""
    gigabytes = num_bytes / 1.0e9
    if gigabytes == 0:
        return 0.0
    magnitude = math.floor(math.log10(abs(gigabytes)))
    return round(gigabytes, 4 - magnitude)


def format_memory_stats(
    stats: Mapping[str, Any], memory_keys: Mapping[str, str] | None = None
) -> dict[str, int | float]:
    """Select and convert ``torch.cuda.memory_stats()``-style statistics.

    Args:
        stats: The statistics (key -> number).
        memory_keys: Statistic key -> reported name (default :data:`MEMORY_KEYS`).

    Returns:
        ``{name: value}`` for the keys present in ``stats``: byte counts (keys containing
        ``bytes``) as gigabytes with 5 significant digits, other counters as ``int``.
    """
    keys = memory_keys or MEMORY_KEYS
    report: dict[str, int | float] = {}
    for stat_name, name in keys.items():
        if stat_name not in stats:
            continue
        value = stats[stat_name]
        report[name] = _gigabytes(float(value)) if "bytes" in stat_name else int(value)
    return report


def report_memory(memory_keys: dict[str, str] | None = None) -> dict[str, int | float]:
    """Report CUDA memory statistics of the current device.

    =====================  ==========================================================
    current_allocated_mem  Current allocated memory (GB)
    current_active_mem     Current active memory (GB)
    current_inactive_mem   Current inactive, non-releasable memory (GB)
    current_reserved_mem   Current reserved memory (GB)
    peak_allocated_mem     Peak allocated memory (GB)
    peak_active_mem        Peak active memory (GB)
    peak_inactive_mem      Peak inactive, non-releasable memory (GB)
    peak_reserved_mem      Peak reserved memory (GB)
    alloc_retries          Failed cudaMalloc calls that caused a cache flush and retry
    =====================  ==========================================================

    Args:
        memory_keys: ``torch.cuda.memory_stats()`` key -> reported name (default
            :data:`MEMORY_KEYS`).

    Returns:
        ``{name: value}``. Without CUDA the report is empty and a one-time notice says so.
    """
    if not torch.cuda.is_available():
        notice_once(
            "memory-cpu",
            "memory reports need CUDA (torch.cuda.memory_stats); no memory metrics are "
            "reported on this CPU-only machine",
        )
        return {}
    return format_memory_stats(torch.cuda.memory_stats(), memory_keys)


def reduce_max_memory_across_pp_group(
    memory_report: dict[str, int | float], pp_group: Any
) -> dict[str, int | float]:
    """Reduce per-rank memory metrics across the pipeline-parallel group with MAX.

    The writers live on the last rank (the last pipeline stage) while peak memory is
    usually reached on the first stage; this gives the writer rank the per-metric maximum
    over the pipeline in one bulk all-reduce. Integer counters stay ``int``.

    Every rank of ``pp_group`` must call it with the same keys in the same order.

    Args:
        memory_report: Metric name -> this rank's value.
        pp_group: The pipeline-parallel process group.

    Returns:
        A new dict of per-metric maxima, or ``memory_report`` itself when
        torch.distributed is not initialised, ``pp_group`` is ``None`` or has one rank,
        or the report is empty.
    """
    if not memory_report or pp_group is None or not dist_ready() or get_pg_size(pp_group) <= 1:
        return memory_report
    keys = list(memory_report)
    values = torch.tensor(
        [float(memory_report[k]) for k in keys],
        dtype=torch.float64,
        device=collective_device(pp_group),
    )
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=pp_group)
    reduced: dict[str, int | float] = {}
    for key, value in zip(keys, values.tolist(), strict=True):
        original = memory_report[key]
        is_counter = isinstance(original, int) and not isinstance(original, bool)
        reduced[key] = int(value) if is_counter else value
    return reduced


def _profiled(profiling: ProfilingConfig | None) -> bool:
    return (
        profiling is not None
        and profiling.record_memory_history
        and global_rank() in profiling.profile_ranks
    )


def _unused_path(path: Path) -> Path:
    """``path``, or ``path`` with ``.1``, ``.2``, ... before the suffix if it exists."""
    candidate, n = path, 0
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.stem}.{n}{path.suffix}")
    return candidate


def _snapshot_path(profiling: ProfilingConfig, tag: str) -> Path:
    base, ext = os.path.splitext(profiling.memory_snapshot_path)
    return _unused_path(Path(f"{base}_{tag}{ext}"))


def _dump_snapshot(path: Path) -> None:
    snapshot = torch.cuda.memory._snapshot()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("xb") as f:  # never overwrite a snapshot the user kept
        pickle.dump(snapshot, f)


def start_memory_history_recording(profiling: ProfilingConfig | None) -> None:
    """Enable the CUDA caching-allocator trace so memory snapshots contain history.

    Call it before the model is built so every allocation is recorded. Only ranks in
    ``profiling.profile_ranks`` record (the trace costs time and memory). On out-of-memory
    a snapshot is written to ``<memory_snapshot_path stem>_oom_rank-<rank><suffix>``;
    :func:`bridge.logging.training_log` writes one at ``profile_step_end``.

    Without CUDA this is a no-op with a one-time notice.

    Args:
        profiling: The profiling section (``None`` or ``record_memory_history=False``:
            nothing happens).
    """
    if not _profiled(profiling):
        return
    assert profiling is not None
    if not torch.cuda.is_available():
        notice_once(
            "memory-history-cpu",
            "ProfilingConfig.record_memory_history needs CUDA (the caching-allocator "
            "trace); no memory history is recorded on this CPU-only machine",
        )
        return
    torch.cuda.memory._record_memory_history(
        enabled="all", context="all", stacks="python", max_entries=100_000
    )
    rank = global_rank()

    def _on_oom(device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        path = _snapshot_path(profiling, f"oom_rank-{rank}")
        _dump_snapshot(path)
        logger.info("[OOM] rank %d saved a memory snapshot to %s", rank, path)

    attach_observer = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach_observer is not None:
        attach_observer(_on_oom)
    logger.info(
        "memory history recording enabled on rank %d; snapshots go next to %s",
        rank,
        profiling.memory_snapshot_path,
    )


def maybe_dump_memory_snapshot(profiling: ProfilingConfig | None, iteration: int) -> Path | None:
    """Write the allocator snapshot at ``profiling.profile_step_end`` on profiled ranks.

    Args:
        profiling: The profiling section.
        iteration: The current iteration.

    Returns:
        The file written, or ``None`` (not due, not profiled, or no CUDA).
    """
    if not _profiled(profiling):
        return None
    assert profiling is not None
    if iteration != profiling.profile_step_end or not torch.cuda.is_available():
        return None
    path = _snapshot_path(profiling, str(global_rank()))
    _dump_snapshot(path)
    logger.info("saved a memory snapshot to %s", path)
    return path
