"""The metrics processor: the loss accumulator, memory-report flag, wall-clock history and
console progress of the loop, and the call of the metric writers after every step.

Built from the ``logger``, ``train`` and ``profiling`` sections (as
:class:`bridge.logging.TrainingLogSettings`) and the run's counters, timers and writers."""

from __future__ import annotations

import collections
import sys
import time
from typing import TYPE_CHECKING, Any

from megatron.core.num_microbatches_calculator import get_num_microbatches

from bridge.config import ModelConfigProtocol, TrainingConfig
from bridge.logging import LoggingState, ProgressReporter, TrainingLogSettings, log_training_step
from bridge.train.metrics.moe import moe_track_names, report_moe_metrics
from bridge.train.metrics.norms import calc_params_l2_norm
from core_utils.callbacks import Callback
from core_utils.distributed import global_rank, global_world_size

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer

    from core_utils.loop import LoopContext

__all__ = ["MetricsProcessor", "learning_rates"]


def learning_rates(optimizer: MegatronOptimizer) -> tuple[float | None, float | None]:
    """``(learning rate, decoupled learning rate)`` of the optimizer's parameter groups."""
    learning_rate: float | None = None
    decoupled: float | None = None
    for group in optimizer.param_groups:
        if len(group["params"]) == 0:
            continue
        if group.get("is_decoupled_lr", False):
            decoupled = float(group["lr"])
        else:
            learning_rate = float(group["lr"])
    return learning_rate, decoupled


def _stdout_is_terminal() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def _total_iterations(train: TrainingConfig) -> int | None:
    """Iterations of the whole run (estimated for sample-based runs with ramp-up)."""
    if train.train_iters is not None:
        return int(train.train_iters)
    if train.train_samples is not None and train.global_batch_size:
        return -(-int(train.train_samples) // int(train.global_batch_size))
    return None


class MetricsProcessor(Callback):
    """Calls :func:`bridge.logging.log_training_step` (the reference's ``training_log``)
    after every completed step, holding the state it carries between steps. A
    mixture-of-experts model's auxiliary losses are reported first
    (:func:`bridge.train.metrics.moe.report_moe_metrics`), so they join the interval's
    losses.

    The step's losses and gradient norm are handed over as the step left them (tensors on
    the device when they are); the logging reads them on the host only for a metric
    record or console line. The progress bar (last rank, on a terminal) reads the loss
    every step only when it is shown.

    Args:
        settings: The ``logger``, ``train`` and ``profiling`` sections, tokens per sample
            and the data-parallel size.
        state: The run's counters, timers, metric writers and start time.
        model_config: The model config (``bf16``), for ``logger.log_params_norm``.
        loaded_iteration: Iteration this job resumed from (0 for a fresh run).
        progress: Show the progress bar (default: on the last rank when stdout is a
            terminal).

    Attributes:
        total_loss_dict: Losses accumulated since the last console line.
        report_memory_flag: A memory report is still due at the next console line.
        history_wct: Wall-clock seconds since the job started, per recent iteration.
    """

    def __init__(
        self,
        settings: TrainingLogSettings,
        state: LoggingState,
        *,
        model_config: ModelConfigProtocol | None = None,
        loaded_iteration: int = 0,
        progress: bool | None = None,
    ) -> None:
        self.settings = settings
        self.state = state
        self.model_config = model_config
        self.loaded_iteration = loaded_iteration
        logger_cfg = settings.logger
        window = max(
            state.metric_writers.report_settings.throughput_window_size or 0,
            logger_cfg.throughput_window_size or 0,
            logger_cfg.log_interval,
        )
        # bridge.logging reads at most window + 1 timestamps.
        self.history_wct: collections.deque[float] = collections.deque(maxlen=window + 1)
        self.total_loss_dict: dict[str, Any] = {}
        self.report_memory_flag = True
        self.log_params_norm = bool(logger_cfg.log_params_norm)
        self.moe = bool(moe_track_names(model_config))
        self.tensorboard_interval = int(logger_cfg.tensorboard_log_interval)
        total = _total_iterations(settings.train)
        step = int(state.train_state.step)
        if progress is None:
            last = global_rank() == global_world_size() - 1
            progress = last and _stdout_is_terminal()
        self.progress = ProgressReporter(
            max(total or 1, step, 1), start=min(step, max(total or 1, 1)), enabled=progress
        )

    def on_train_start(self, context: LoopContext) -> None:
        """Start the progress display."""
        self.progress.start()

    def on_step_end(self, context: LoopContext) -> None:
        """Log the completed step (metric records, console line every ``log_interval``)."""
        result = context.step_result
        assert result is not None
        if not result.completed:
            return
        state = self.state
        self.history_wct.append(time.time() - state.start_time)
        learning_rate, decoupled_learning_rate = learning_rates(context.optimizer)
        params_norm = (
            calc_params_l2_norm(context.model, self.model_config) if self.log_params_norm else None
        )
        if self.moe:
            # Every rank (the reduction is collective); written at TensorBoard intervals.
            writers = state.metric_writers
            due = context.iteration % self.tensorboard_interval == 0
            report_moe_metrics(
                self.model_config,
                context.iteration,
                get_num_microbatches(),
                writers if writers.enabled and due else None,
                self.total_loss_dict,
            )
        self.report_memory_flag = log_training_step(
            result.losses,
            self.total_loss_dict,
            learning_rate,
            decoupled_learning_rate,
            # A tensor for megatron-style optimizers: read only when a line or record needs it.
            context.optimizer.get_loss_scale(),
            self.report_memory_flag,
            int(result.skipped),
            result.grad_norm,
            params_norm,
            result.num_zeros_in_grad,
            self.settings,
            state,
            self.history_wct,
            context.model,
            loaded_iteration=self.loaded_iteration,
        )
        if self.progress.enabled and "lm loss" in result.losses:
            self.progress.update(context.iteration, {"lm loss": float(result.losses["lm loss"])})
        else:
            self.progress.update(context.iteration)

    def close(self) -> None:
        """Close the progress display (idempotent; also after an error)."""
        self.progress.close()
