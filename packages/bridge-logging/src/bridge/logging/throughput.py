"""Rolling throughput and the remaining-time estimate."""

from __future__ import annotations

import time
from collections.abc import Sequence

from bridge.config import TrainingConfig
from bridge.logging._notices import notice_once
from bridge.logging.protocols import TrainProgress
from bridge.logging.settings import TIME_UNITS
from core_utils.distributed import global_world_size

__all__ = ["report_runtime", "report_throughput"]


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def report_throughput(
    train_config: TrainingConfig,
    iteration: int,
    seq_length: int | None,
    history_wct: Sequence[float],
    window_size: int,
    *,
    samples_in_window: float | None = None,
) -> dict[str, float]:
    """Throughput averaged over the last ``window_size`` iterations.

    ``history_wct`` holds wall-clock timestamps in seconds from any fixed origin (the
    trainer appends ``time.time() - start_time`` after each iteration), oldest first, the
    last one taken at the end of ``iteration``. ``window_size`` iterations span
    ``window_size + 1`` timestamps: the rate is ``window_size`` batches over
    ``history_wct[-1] - history_wct[-(window_size + 1)]`` seconds. A trainer that also
    appends a timestamp when training starts gets its first report after ``window_size``
    iterations; keep at least ``window_size + 1`` entries.

    =================================  ==============================================
    throughput/batches_per_sec         iterations (global batches) per second
    throughput/samples_per_sec         samples of the window per second
    throughput/tokens_per_sec          samples/s x ``seq_length``
    throughput/device/batches_per_sec  batches/s / world size
    throughput/device/samples_per_sec  samples/s / world size
    throughput/device/tokens_per_sec   tokens/s / world size
    =================================  ==============================================

    The samples of the window are ``samples_in_window`` when given (what
    :func:`bridge.logging.training_log` passes: the increase of the consumed-sample
    counter over the window, right during a batch-size ramp-up), else ``window_size x
    global_batch_size``. The token metrics need ``seq_length``.

    Args:
        train_config: The training section (``global_batch_size`` must be set, as
            ``ConfigContainer.validate()`` does, unless ``samples_in_window`` is given).
        iteration: The current iteration (at least ``window_size``).
        seq_length: Tokens per sample; ``None`` (unknown) leaves the token metrics out.
        history_wct: Timestamps as above.
        window_size: Iterations in the window.
        samples_in_window: Samples consumed by the window's iterations.

    Returns:
        The metrics, or ``{}`` while fewer than ``window_size + 1`` timestamps exist or
        when the window's duration is not positive (e.g. timestamps reset on resume).

    Raises:
        ValueError: ``window_size`` or ``seq_length`` is not a positive int,
            ``samples_in_window`` is negative, or ``global_batch_size`` is needed and not
            a positive int.
    """
    window = _positive_int("window_size", window_size)
    tokens_per_sample = None if seq_length is None else _positive_int("seq_length", seq_length)
    if samples_in_window is None:
        global_batch_size = train_config.global_batch_size
        if (
            isinstance(global_batch_size, bool)
            or not isinstance(global_batch_size, int)
            or global_batch_size < 1
        ):
            raise ValueError(
                "train_config.global_batch_size must be a positive int, got "
                f"{global_batch_size!r}; set it or call ConfigContainer.validate() first"
            )
        samples = float(window * global_batch_size)
    elif samples_in_window < 0:
        raise ValueError(f"samples_in_window must not be negative, got {samples_in_window!r}")
    else:
        samples = float(samples_in_window)
    if len(history_wct) < window + 1 or iteration < window:
        return {}
    elapsed = float(history_wct[-1]) - float(history_wct[-(window + 1)])
    if elapsed <= 0:
        notice_once(
            "throughput-nonpositive",
            f"throughput window ending at iteration {iteration} lasted {elapsed} s; "
            "history_wct must hold increasing timestamps, skipping throughput",
        )
        return {}
    world = global_world_size()
    batches_per_sec = window / elapsed
    samples_per_sec = samples / elapsed
    metrics = {
        "throughput/batches_per_sec": batches_per_sec,
        "throughput/samples_per_sec": samples_per_sec,
        "throughput/device/batches_per_sec": batches_per_sec / world,
        "throughput/device/samples_per_sec": samples_per_sec / world,
    }
    if tokens_per_sample is not None:
        tokens_per_sec = samples_per_sec * tokens_per_sample
        metrics["throughput/tokens_per_sec"] = tokens_per_sec
        metrics["throughput/device/tokens_per_sec"] = tokens_per_sec / world
    return metrics


def report_runtime(
    train_state: TrainProgress,
    start_time: float,
    seq_length: int | None,
    train_iters: int | None,
    time_unit: str = "seconds",
    *,
    start_iteration: int = 0,
    now: float | None = None,
) -> dict[str, float]:
    """Elapsed time, consumption counters and an estimate of the time left.

    The estimate assumes the iterations still to run take as long, on average, as those
    run since ``start_time``: ``elapsed / (step - start_iteration) * (train_iters -
    step)``. It is a best effort and drifts when throughput changes.

    =======================  =====================================================
    time/remaining_estimate  estimated time to completion (omitted before the
                             first iteration of this job, and without
                             ``train_iters``)
    time/tokens              consumed training samples x ``seq_length`` (omitted
                             when ``seq_length`` is ``None``)
    time/samples             consumed training samples
    time/batches             iterations completed (``train_state.step``)
    time/total               time since ``start_time``
    =======================  =====================================================

    Args:
        train_state: Progress counters.
        start_time: ``time.time()`` when this job started.
        seq_length: Tokens per sample (``None``: unknown, ``time/tokens`` is left out).
        train_iters: Iterations the run trains for (``None``: unknown, as in
            sample-based training; ``time/remaining_estimate`` is left out).
        time_unit: Unit of the durations: ``"seconds"``, ``"minutes"``, ``"hours"`` or
            ``"days"``.
        start_iteration: ``train_state.step`` when this job started (the loaded
            iteration on resume), so the rate counts only this job's iterations.
        now: Current ``time.time()`` (default: read the clock).

    Returns:
        The metrics above.

    Raises:
        ValueError: ``time_unit`` is unknown, or ``train_iters`` / ``seq_length`` is not
            a positive int.
    """
    if time_unit not in TIME_UNITS:
        raise ValueError(
            f"time_unit must be one of {', '.join(map(repr, TIME_UNITS))}, got {time_unit!r}"
        )
    if train_iters is not None:
        _positive_int("train_iters", train_iters)
    if seq_length is not None:
        _positive_int("seq_length", seq_length)
    divider = TIME_UNITS[time_unit]
    elapsed = (time.time() if now is None else now) - start_time
    done_this_job = train_state.step - start_iteration
    metrics: dict[str, float] = {}
    if done_this_job > 0 and train_iters is not None:
        remaining_iters = max(train_iters - train_state.step, 0)
        metrics["time/remaining_estimate"] = elapsed / done_this_job * remaining_iters / divider
    if seq_length is not None:
        metrics["time/tokens"] = float(train_state.consumed_train_samples * seq_length)
    metrics["time/samples"] = float(train_state.consumed_train_samples)
    metrics["time/batches"] = float(train_state.step)
    metrics["time/total"] = elapsed / divider
    return metrics
