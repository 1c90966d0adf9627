"""``training_log``: the per-iteration console line and metrics of the training loop."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import torch

from bridge.config import (
    ConfigContainer,
    FinetuningDatasetConfig,
    GPTDatasetConfig,
    LoggerConfig,
    ModelConfigProtocol,
    ProfilingConfig,
    TrainingConfig,
)
from bridge.logging._dist import (
    find_pg_collection,
    pg_attr,
    print_rank_last,
    reduce_max_stat,
)
from bridge.logging._notices import notice_once
from bridge.logging.energy import EnergyMonitor
from bridge.logging.grad_norm import report_l2_norm_grad
from bridge.logging.memory import (
    maybe_dump_memory_snapshot,
    reduce_max_memory_across_pp_group,
    report_memory,
)
from bridge.logging.metric_writers import MetricWriters, _IntervalMarks
from bridge.logging.protocols import LoggingState
from bridge.logging.throughput import report_runtime, report_throughput
from core_utils import Timers
from core_utils.distributed import global_rank, global_world_size
from core_utils.process_groups import get_pg_rank

__all__ = [
    "TIMERS_LEVEL_1",
    "TIMERS_LEVEL_2",
    "TrainingLogSettings",
    "build_timers",
    "log_training_step",
    "loss_value",
    "timers_to_log",
    "tokens_per_sample",
    "training_log",
]

ADVANCED_ITERS = "advanced iterations"
SKIPPED_ITERS = "skipped iterations"
NAN_ITERS = "nan iterations"
_COUNTERS = (ADVANCED_ITERS, SKIPPED_ITERS, NAN_ITERS)

TIMERS_LEVEL_1: tuple[str, ...] = (
    "forward-backward",
    "layernorm-grads-all-reduce",
    "embedding-grads-all-reduce",
    "all-grads-sync",
    "params-all-gather",
    "optimizer-copy-to-main-grad",
    "optimizer-unscale-and-check-inf",
    "optimizer-clip-main-grad",
    "optimizer-count-zeros",
    "optimizer-inner-step",
    "optimizer-copy-main-to-model-params",
    "optimizer",
)
"""Timers reported (console and ``<name>-time`` tags) at ``timing_log_level >= 1``."""

TIMERS_LEVEL_2: tuple[str, ...] = (
    "batch-generator",
    "forward-compute",
    "backward-compute",
    "forward-recv",
    "forward-send",
    "backward-recv",
    "backward-send",
    "forward-send-forward-recv",
    "forward-send-backward-recv",
    "backward-send-forward-recv",
    "backward-send-backward-recv",
    "forward-backward-send-forward-backward-recv",
)
"""Timers added at ``timing_log_level == 2``."""


def timers_to_log(timing_log_level: int) -> list[str]:
    """Names of the timers reported at ``timing_log_level`` (0: none besides the iteration)."""
    names: list[str] = []
    if timing_log_level >= 1:
        names.extend(TIMERS_LEVEL_1)
    if timing_log_level >= 2:
        names.extend(TIMERS_LEVEL_2)
    return names


def build_timers(logger_cfg: LoggerConfig) -> Timers:
    """The run's timers, at ``logger_cfg.timing_log_level`` and ``timing_log_option``.

    Args:
        logger_cfg: The logger section.

    Returns:
        A :class:`core_utils.Timers`; start ``timers("interval-time", log_level=0)``
        before the training loop, as :func:`training_log` reads it.
    """
    return Timers(logger_cfg.timing_log_level, logger_cfg.timing_log_option)


def loss_value(key: str, value: Any) -> float:
    """One loss as a float: a number, a one-element tensor, or a ``[sum, count]`` pair.

    Raises:
        ValueError: Any other shape.
    """
    if isinstance(value, torch.Tensor):
        flat = value.detach().float().reshape(-1)
        if flat.numel() == 1:
            return float(flat.item())
        if flat.numel() == 2:  # megatron's (sum, number of tokens) reporting form
            return float(flat[0].item() / flat[1].item()) if flat[1].item() else math.nan
        raise ValueError(
            f"loss_dict[{key!r}] has shape {tuple(value.shape)}; expected a scalar or a "
            "[sum, count] pair (reduce it across microbatches first)"
        )
    return float(value)


def _as_float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().sum().item())
    return float(value)


def _loss_tensor(key: str, value: torch.Tensor) -> torch.Tensor:
    """:func:`loss_value` as a 0-d float64 tensor on the loss's device (no host sync); the
    same value, rounded through float32 as :func:`loss_value` rounds it."""
    flat = value.detach().float().reshape(-1)
    if flat.numel() == 1:
        return flat[0].double()
    if flat.numel() == 2:  # megatron's (sum, number of tokens) reporting form
        count = flat[1].double()
        return torch.where(count != 0, flat[0].double() / count, torch.nan)
    raise ValueError(
        f"loss_dict[{key!r}] has shape {tuple(value.shape)}; expected a scalar or a "
        "[sum, count] pair (reduce it across microbatches first)"
    )


def _accumulate(
    loss_dict: dict[str, Any], total: dict[str, Any], skipped_iter: int
) -> dict[str, Any]:
    """Add this iteration to the interval counters; returns the iteration's losses.

    Tensor losses stay tensors on their device (the sums and the non-finite count too), so
    an iteration that writes no metric and no console line does not wait for the device;
    ``float()`` of a returned value reads it.
    """
    losses: dict[str, Any] = {
        key: _loss_tensor(key, value) if isinstance(value, torch.Tensor) else float(value)
        for key, value in loss_dict.items()
    }
    if skipped_iter:
        total.setdefault(ADVANCED_ITERS, 0)
    else:
        total[ADVANCED_ITERS] = total.get(ADVANCED_ITERS, 0) + 1
        for key, value in losses.items():
            total[key] = total.get(key, 0.0) + value
    total[SKIPPED_ITERS] = total.get(SKIPPED_ITERS, 0) + int(bool(skipped_iter))
    on_device = [v for v in losses.values() if isinstance(v, torch.Tensor)]
    non_finite: Any = int(
        any(not math.isfinite(v) for v in losses.values() if isinstance(v, float))
    )
    if on_device:
        non_finite = (~torch.isfinite(torch.stack(on_device))).any().to(torch.int64) | non_finite
    total[NAN_ITERS] = total.get(NAN_ITERS, 0) + non_finite
    return losses


def _configured_batch_size(settings: TrainingLogSettings) -> int:
    train_cfg = settings.train
    if train_cfg.global_batch_size is not None:
        return int(train_cfg.global_batch_size)
    dp = settings.data_parallel_size or 1
    return int(train_cfg.micro_batch_size or 0) * dp


def _batch_size_if_certain(settings: TrainingLogSettings, consumed: int) -> int | None:
    """The configured batch size when the iteration that ended at ``consumed`` samples
    must have run it (no ramp-up, or past it, and no shrinking to fit), else ``None``."""
    train_cfg = settings.train
    if train_cfg.decrease_batch_size_if_needed:
        return None
    configured = _configured_batch_size(settings)
    rampup = train_cfg.rampup_batch_size
    # The batch is at most the configured one, so the ramp-up was over before this
    # iteration if it was over even counting the largest batch.
    if rampup is None or consumed - configured >= int(rampup[2]):
        return configured
    return None


def _format_batch_size(batch_size: float | None) -> str:
    if batch_size is None:
        return "  N/A"
    if float(batch_size).is_integer():
        return f"{int(batch_size):5d}"
    return f"{batch_size:7.1f}"  # an average over iterations not logged one by one


def tokens_per_sample(
    model: ModelConfigProtocol | None,
    dataset: GPTDatasetConfig | FinetuningDatasetConfig | None,
    seq_length: int | None = None,
) -> int | None:
    """Tokens per sample for the token metrics: ``seq_length`` if given, else the model's
    ``seq_length``, else the dataset's ``sequence_length`` / ``seq_length``, else ``None``."""
    if seq_length is not None:
        return seq_length
    model_len = getattr(model, "seq_length", None)
    if model_len:
        return int(model_len)
    data_len = getattr(dataset, "sequence_length", None) or getattr(dataset, "seq_length", None)
    return int(data_len) if data_len else None


@dataclass(frozen=True)
class TrainingLogSettings:
    """What :func:`log_training_step` reads of a run's configuration, and nothing more.

    Built once when a loop starts (bridge-train's metrics component does); the reference's
    :func:`training_log` builds it from the whole config on every call.

    Attributes:
        logger: The ``logger`` section (intervals, what to log).
        train: The ``train`` section (length, batch sizes and their ramp-up).
        profiling: The ``profiling`` section (memory snapshots), if any.
        seq_length: Tokens per sample (``None``: no token metrics), see
            :func:`tokens_per_sample`.
        data_parallel_size: The data-parallel size, for the configured batch size when
            ``train.global_batch_size`` is unset.
    """

    logger: LoggerConfig
    train: TrainingConfig
    profiling: ProfilingConfig | None = None
    seq_length: int | None = None
    data_parallel_size: int | None = None


def _track_flops(
    marks: _IntervalMarks, flops_now: float, iteration: int, loaded_iteration: int
) -> None:
    """Record this call's FLOPs delta (unknown for the first call of a resumed job)."""
    previous = marks.previous_flops
    if previous is None and loaded_iteration == 0 and iteration == 1:
        previous = 0.0  # a fresh run's counter starts at zero
    if previous is not None:
        marks.known_flops += max(flops_now - previous, 0.0)
        marks.known_iterations += 1
    marks.previous_flops = flops_now


def _interval_tflops_per_device(
    marks: _IntervalMarks, iterations: int, elapsed: float, world: int
) -> float | None:
    """TFLOP/s per device over the interval; ``None`` when no FLOPs delta is known yet.

    Normally every iteration's delta is known and this is the counter's increase since
    the previous log divided by the interval time. Only the first interval of a resumed
    job misses its first iteration's delta, which is then taken as the interval average.
    """
    known, count = marks.known_flops, marks.known_iterations
    marks.known_flops, marks.known_iterations = 0.0, 0
    if count == 0 or elapsed <= 0:
        return None
    interval_flops = known / count * iterations
    return interval_flops / elapsed / world / 1e12


class _Collector:
    """A writer for ``Timers.write`` that gathers its values into this step's metrics."""

    def __init__(self, metrics: dict[str, float]) -> None:
        self._metrics = metrics

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._metrics[tag] = float(value)


_STAMP: list[Any] = [None, ""]  # the second the last timestamp was made for, and its text


def _timestamp() -> str:
    """The console line's local time, formatted once per second."""
    second = int(time.time())
    if second != _STAMP[0]:
        _STAMP[:] = [second, datetime.fromtimestamp(second).strftime("%Y-%m-%d %H:%M:%S")]
    return str(_STAMP[1])


def _format_tflops(value: float) -> str:
    return f"{value:.1f}" if value >= 1 else f"{value:.3g}"


def _energy(writers: MetricWriters, logger_cfg: LoggerConfig) -> EnergyMonitor | None:
    marks = writers.marks
    if not logger_cfg.log_energy or marks.energy_unavailable:
        return None
    if marks.energy_monitor is None:
        try:
            marks.energy_monitor = EnergyMonitor()
        except (RuntimeError, ImportError) as exc:
            marks.energy_unavailable = True
            notice_once("energy", f"energy is not logged: {exc}")
            return None
    monitor: EnergyMonitor = marks.energy_monitor
    return monitor


def _is_last_iteration(train_cfg: TrainingConfig, iteration: int, consumed: int) -> bool:
    """Whether ``iteration`` ends the run (its console line is due whatever the interval)."""
    if train_cfg.train_samples is not None:
        return consumed >= train_cfg.train_samples
    return train_cfg.train_iters is not None and iteration >= train_cfg.train_iters


def training_log(
    loss_dict: dict[str, torch.Tensor],
    total_loss_dict: dict[str, Any],
    learning_rate: float | None,
    decoupled_learning_rate: float | None,
    loss_scale: float | torch.Tensor,
    report_memory_flag: bool,
    skipped_iter: int,
    grad_norm: float | torch.Tensor | None,
    params_norm: float | None,
    num_zeros_in_grad: int | float | torch.Tensor | None,
    config: ConfigContainer,
    global_state: LoggingState,
    history_wct: Sequence[float],
    model: list[Any],
    pg_collection: Any | None = None,
    log_max_attention_logit: float | None = None,
    loaded_iteration: int = 0,
    seq_length: int | None = None,
) -> bool:
    """Log training stats (losses, learning rate, timings, etc.).

    Call it on every rank after every iteration (after ``train_state.step``,
    ``consumed_train_samples`` and ``floating_point_operations_so_far`` were advanced);
    it takes part in collectives (timers, memory and learning-rate reductions). Losses
    accumulate in ``total_loss_dict`` between console lines.

    Every ``logger.tensorboard_log_interval`` iterations the metric writers (last rank)
    receive ``learning-rate``, ``batch-size``, each loss, ``loss-scale``, ``grad-norm``,
    ``num-zeros``, ``params-norm``, ``world-size`` ... as switched on (see
    docs/logging.md), plus TensorBoard-only ``<name> vs samples`` twins. Every
    ``logger.log_interval`` iterations, and at the run's last iteration (``train_iters``,
    or ``train_samples`` reached) so that a short run shows its loss too, the last rank
    prints Megatron's console line.

    The batch size (console, ``batch-size``, samples and tokens per second) is the one
    the iteration ran: the increase of ``consumed_train_samples`` since the previous
    call, so it follows a batch-size ramp-up. Only the first call of a resumed job cannot
    derive it; it then uses ``train.global_batch_size`` when that is certain (no ramp-up
    or past it) and otherwise leaves ``batch-size`` out and prints ``N/A``. Without a
    sequence length (``seq_length``, ``model.seq_length``, ``dataset.sequence_length``)
    only the token metrics are left out.

    Args:
        loss_dict: This iteration's losses (reduced across microbatches and DP ranks).
        total_loss_dict: Interval accumulator, the same dict on every call.
        learning_rate: Current learning rate (``None`` on ranks without trainable
            parameters; the maximum over the model-parallel group is used).
        decoupled_learning_rate: Decoupled learning rate, if used.
        loss_scale: Current loss scale (1.0 without mixed-precision scaling).
        report_memory_flag: Print a memory report at the next console line.
        skipped_iter: 1 if the optimizer skipped this iteration, 0 otherwise.
        grad_norm: Gradient norm, if computed.
        params_norm: Parameter norm, if computed (logged when ``log_params_norm``).
        num_zeros_in_grad: Zeros in the gradient, if counted.
        config: The run's configuration (``train`` and ``logger`` sections required).
        global_state: Trainer state (see :class:`bridge.logging.LoggingState`).
        history_wct: Wall-clock timestamps per iteration (see
            :func:`bridge.logging.report_throughput`).
        model: Model chunks (searched for ``pg_collection`` and used for gradient norms).
        pg_collection: Process groups (``mp``, ``pp``, ``tp``, ``dp``, and ``expt_tp`` /
            ``tp_ep_pp`` for expert gradient norms) for the reductions; default: the
            model's, else no reduction.
        log_max_attention_logit: Maximum attention logit, if tracked.
        loaded_iteration: Iteration this job resumed from (0 for a fresh run).
        seq_length: Tokens per sample (default ``config.model.seq_length``, else the
            dataset's sequence length; unknown: no token metrics).

    Returns:
        The updated ``report_memory_flag`` (false once memory was reported after the
        second iteration of the job).

    Raises:
        ValueError: ``config`` lacks a ``train`` or ``logger`` section, a loss has an
            unexpected shape, or gradient norms are on and a process group they need is
            missing (see :func:`bridge.logging.report_l2_norm_grad`).
    """
    if config.logger is None or config.train is None:
        missing = "logger" if config.logger is None else "train"
        raise ValueError(f"training_log: config.{missing} is None; the section is required")
    settings = TrainingLogSettings(
        logger=config.logger,
        train=config.train,
        profiling=config.profiling,
        seq_length=tokens_per_sample(config.model, config.dataset, seq_length),
        data_parallel_size=config.data_parallel_size,
    )
    return log_training_step(
        loss_dict,
        total_loss_dict,
        learning_rate,
        decoupled_learning_rate,
        loss_scale,
        report_memory_flag,
        skipped_iter,
        grad_norm,
        params_norm,
        num_zeros_in_grad,
        settings,
        global_state,
        history_wct,
        model,
        pg_collection=pg_collection,
        log_max_attention_logit=log_max_attention_logit,
        loaded_iteration=loaded_iteration,
    )


def log_training_step(
    loss_dict: dict[str, torch.Tensor],
    total_loss_dict: dict[str, Any],
    learning_rate: float | None,
    decoupled_learning_rate: float | None,
    loss_scale: float | torch.Tensor,
    report_memory_flag: bool,
    skipped_iter: int,
    grad_norm: float | torch.Tensor | None,
    params_norm: float | None,
    num_zeros_in_grad: int | float | torch.Tensor | None,
    settings: TrainingLogSettings,
    state: LoggingState,
    history_wct: Sequence[float],
    model: list[Any],
    pg_collection: Any | None = None,
    log_max_attention_logit: float | None = None,
    loaded_iteration: int = 0,
) -> bool:
    """:func:`training_log` with the configuration it reads given as :class:`TrainingLogSettings`.

    What the training loop calls after every step (see :func:`training_log` for what is
    logged, when, and the collectives it takes part in).

    Args:
        loss_dict: See :func:`training_log`.
        total_loss_dict: See :func:`training_log`.
        learning_rate: See :func:`training_log`.
        decoupled_learning_rate: See :func:`training_log`.
        loss_scale: See :func:`training_log`.
        report_memory_flag: See :func:`training_log`.
        skipped_iter: See :func:`training_log`.
        grad_norm: See :func:`training_log`.
        params_norm: See :func:`training_log`.
        num_zeros_in_grad: See :func:`training_log`.
        settings: The ``logger``, ``train`` and ``profiling`` sections, tokens per sample
            and the data-parallel size.
        state: Counters, timers, metric writers and start time of the run.
        history_wct: See :func:`training_log`.
        model: See :func:`training_log`.
        pg_collection: See :func:`training_log`.
        log_max_attention_logit: See :func:`training_log`.
        loaded_iteration: See :func:`training_log`.

    Returns:
        The updated ``report_memory_flag``.
    """
    logger_cfg = settings.logger
    train_cfg = settings.train
    writers = state.metric_writers
    timers = state.timers
    train_state = state.train_state
    reports = writers.reports_for(logger_cfg)
    iteration = int(train_state.step)
    consumed = int(train_state.consumed_train_samples)
    world = global_world_size()
    pg = pg_collection if pg_collection is not None else find_pg_collection(model)

    losses = _accumulate(loss_dict, total_loss_dict, skipped_iter)
    _track_flops(
        writers.marks,
        float(train_state.floating_point_operations_so_far),
        iteration,
        loaded_iteration,
    )
    learning_rate = reduce_max_stat(learning_rate, pg_attr(pg, "mp"))
    timer_names = timers_to_log(logger_cfg.timing_log_level)
    window = reports.throughput_window_size or logger_cfg.log_interval
    batch_size = writers.marks.batches.record(
        iteration,
        consumed,
        loaded_iteration=loaded_iteration,
        fallback=_batch_size_if_certain(settings, consumed),
        keep=window,
    )
    total_iterations = total_loss_dict[ADVANCED_ITERS] + total_loss_dict[SKIPPED_ITERS]
    tb_due = iteration % logger_cfg.tensorboard_log_interval == 0
    show_params_norm = logger_cfg.log_params_norm and params_norm is not None
    sample_tokens = settings.seq_length

    # Everything for this step goes out in one log_many call at the end: W&B and MLflow
    # pay a fixed cost per call, and a metric writer process gets one message.
    step_metrics: dict[str, float] = {}
    twins: dict[str, float] = {}

    # Collectives first, on every rank, whether or not this rank writes.
    if logger_cfg.log_timers_to_tensorboard and tb_due:
        # No reset: the console report at the end of the interval reads the same timers;
        # the normaliser makes this the running per-iteration average of the interval.
        timers.write(
            timer_names,
            _Collector(step_metrics),
            iteration,
            normalizer=max(total_iterations, 1),
            reset=False,
        )
    maybe_dump_memory_snapshot(settings.profiling, iteration)
    memory_metrics: dict[str, int | float] = {}
    if logger_cfg.log_memory_to_tensorboard and tb_due:
        report = report_memory(reports.memory_keys)
        report = reduce_max_memory_across_pp_group(report, pg_attr(pg, "pp"))
        memory_metrics = {f"memory/{name}": value for name, value in report.items()}
    grad_norms: dict[str, float] = {}
    if reports.log_l2_norm_grad and tb_due:
        grad_norms = report_l2_norm_grad(model, pg_collection=pg)

    if writers.enabled and tb_due:
        vs_samples: dict[str, float] = {}
        if logger_cfg.log_throughput:
            samples = writers.marks.batches.samples_in_window(iteration, window)
            throughput = report_throughput(
                train_cfg,
                iteration,
                sample_tokens,
                history_wct,
                window,
                samples_in_window=samples if samples is not None else 0.0,
            )
            if samples is None:  # no batch size of the window is known: batches only
                throughput = {k: v for k, v in throughput.items() if "/batches_" in k}
            step_metrics.update(throughput)
        step_metrics.update(memory_metrics)
        if reports.log_runtime:
            step_metrics.update(
                report_runtime(
                    train_state,
                    state.start_time,
                    sample_tokens,
                    train_cfg.train_iters,
                    reports.runtime_time_unit,
                    start_iteration=loaded_iteration,
                )
            )
        step_metrics.update(grad_norms)
        step_metrics["samples vs steps"] = float(consumed)
        if learning_rate is not None:
            vs_samples["learning-rate"] = learning_rate
        if decoupled_learning_rate is not None:
            step_metrics["decoupled-learning-rate"] = float(decoupled_learning_rate)
        if train_state.skipped_train_samples > 0:
            step_metrics["skipped-train-samples"] = float(train_state.skipped_train_samples)
        if batch_size is not None:
            vs_samples["batch-size"] = float(batch_size)
        vs_samples.update({key: float(value) for key, value in losses.items()})
        if logger_cfg.log_loss_scale_to_tensorboard:
            vs_samples["loss-scale"] = float(loss_scale)
        if logger_cfg.log_world_size_to_tensorboard:
            vs_samples["world-size"] = float(world)
        if grad_norm is not None:
            vs_samples["grad-norm"] = _as_float(grad_norm)
        if num_zeros_in_grad is not None:
            vs_samples["num-zeros"] = _as_float(num_zeros_in_grad)
        if show_params_norm:
            vs_samples["params-norm"] = _as_float(params_norm)
        if log_max_attention_logit is not None:
            vs_samples["max-attention-logit"] = _as_float(log_max_attention_logit)
        step_metrics.update(vs_samples)
        twins = {f"{t} vs samples": v for t, v in vs_samples.items()}

    # Steps in samples would go backwards for W&B, so only TensorBoard gets the twins; both
    # go out in one call (one message to a metric writer process).
    records = [(twins, consumed, ("tensorboard",)), (step_metrics, iteration, None)]
    if iteration % logger_cfg.log_interval != 0 and not _is_last_iteration(
        train_cfg, iteration, consumed
    ):
        if writers.enabled:
            writers.log_many(records)
        return report_memory_flag

    elapsed = timers("interval-time", log_level=0).elapsed(barrier=True)
    if elapsed <= 0:
        notice_once(
            "interval-time",
            "timer 'interval-time' measured nothing; start timers('interval-time', "
            "log_level=0) before the training loop to get iteration times and throughput",
        )
    iterations = max(total_iterations, 1)
    time_per_iteration = elapsed / iterations
    tflops = _interval_tflops_per_device(writers.marks, total_iterations, elapsed, world)
    monitor = _energy(writers, logger_cfg)
    energy = monitor.lap() / iterations / world if monitor is not None else None

    if tflops is not None and logger_cfg.log_throughput:
        step_metrics["throughput/tflops/device"] = tflops
        step_metrics["throughput/tflops"] = tflops * world
    if logger_cfg.log_timers_to_tensorboard:
        step_metrics["iteration-time"] = time_per_iteration
    if energy is not None:
        step_metrics["iter-energy/gpu"] = energy
        if time_per_iteration > 0:
            step_metrics["power/gpu"] = energy / time_per_iteration
    if writers.enabled:
        writers.log_many(records)

    total_iters_text = (
        f"{train_cfg.train_iters:8d}" if train_cfg.train_iters is not None else "       ?"
    )
    parts = [
        f" [{_timestamp()}] iteration {iteration:8d}/{total_iters_text} |",
        f" consumed samples: {consumed:12d} |",
    ]
    if train_state.skipped_train_samples > 0:
        parts.append(f" skipped samples: {int(train_state.skipped_train_samples):12d} |")
    parts.append(f" elapsed time per iteration (ms): {time_per_iteration * 1000.0:.1f} |")
    if tflops is not None and logger_cfg.log_throughput:
        parts.append(f" throughput per GPU (TFLOP/s/GPU): {_format_tflops(tflops)} |")
    if energy is not None:
        parts.append(f" energy per GPU (J/iter/GPU): {energy:.1f} |")
        if time_per_iteration > 0:
            parts.append(f" power per GPU (W/GPU): {energy / time_per_iteration:.1f} |")
    parts.append(
        f" learning rate: {learning_rate:.6E} |"
        if learning_rate is not None
        else " learning rate: N/A |"
    )
    if decoupled_learning_rate is not None:
        parts.append(f" decoupled learning rate: {float(decoupled_learning_rate):.6E} |")
    parts.append(f" global batch size: {_format_batch_size(batch_size)} |")
    advanced = max(int(total_loss_dict[ADVANCED_ITERS]), 1)
    for key in [k for k in total_loss_dict if k not in _COUNTERS]:
        # Negative losses (e.g. rewards) are printed too; the accumulator restarts.
        parts.append(f" {key}: {_as_float(total_loss_dict.pop(key)) / advanced:.6E} |")
    parts.append(f" loss scale: {float(loss_scale):.1f} |")
    if grad_norm is not None:
        parts.append(f" grad norm: {_as_float(grad_norm):.3f} |")
    if num_zeros_in_grad is not None:
        parts.append(f" num zeros: {int(_as_float(num_zeros_in_grad))} |")
    if show_params_norm:
        parts.append(f" params norm: {_as_float(params_norm):.3f} |")
    if log_max_attention_logit is not None:
        parts.append(f" max attention logit: {_as_float(log_max_attention_logit):.3f} |")
    parts.append(f" number of skipped iterations: {int(total_loss_dict[SKIPPED_ITERS]):3d} |")
    parts.append(f" number of nan iterations: {int(total_loss_dict[NAN_ITERS]):3d} |")
    for counter in _COUNTERS:
        total_loss_dict[counter] = 0
    print_rank_last("".join(parts))

    if report_memory_flag:
        report = report_memory(reports.memory_keys)
        dp_group = pg_attr(pg, "dp")
        first_dp = get_pg_rank(dp_group) == 0 if dp_group is not None else global_rank() == 0
        if report and first_dp:
            text = " | ".join(f"{name}: {value}" for name, value in report.items())
            print(
                f"[Rank {global_rank()}] (after {iteration} iterations) memory (GB) | {text}",
                flush=True,
            )
        if iteration > loaded_iteration + 1:
            report_memory_flag = False  # the second iteration includes optimizer state
    timers.log(timer_names, normalizer=iterations)
    return report_memory_flag
