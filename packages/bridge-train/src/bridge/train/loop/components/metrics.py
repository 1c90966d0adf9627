"""The metrics processor: the loss accumulator, memory-report flag, wall-clock history and
console progress of the loop, and the call of the metric writers after every step."""

from __future__ import annotations

import collections
import sys
import time
from typing import TYPE_CHECKING, Any

from bridge.logging import ProgressReporter, training_log
from bridge.train.metrics.moe import moe_track_names, report_moe_metrics
from bridge.train.metrics.norms import calc_params_l2_norm
from core_utils.callbacks import Callback
from core_utils.distributed import global_rank, global_world_size

if TYPE_CHECKING:
    from bridge.train.loop.run_loop import LoopContext

__all__ = ["MetricsProcessor", "learning_rates"]


def learning_rates(optimizer: Any) -> tuple[float | None, float | None]:
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


def _total_iterations(cfg: Any) -> int | None:
    """Iterations of the whole run (estimated for sample-based runs with ramp-up)."""
    train = cfg.train
    if train.train_iters is not None:
        return int(train.train_iters)
    if train.train_samples is not None and train.global_batch_size:
        return -(-int(train.train_samples) // int(train.global_batch_size))
    return None


class MetricsProcessor(Callback):
    """Calls :func:`bridge.logging.training_log` after every completed step, holding the
    state it carries between steps. A mixture-of-experts model's auxiliary losses are
    reported first (:func:`bridge.train.metrics.moe.report_moe_metrics`), so they join the
    interval's losses.

    The step's losses and gradient norm are handed over as the step left them (tensors on
    the device when they are); ``training_log`` reads them on the host only for a metric
    record or console line. The progress bar (last rank, on a terminal) reads the loss
    every step only when it is shown.

    Args:
        state: The run's global state (config, writers, timers, counters).
        seq_length: Tokens per sample for throughput metrics (``None``: from the config).
        progress: Show the progress bar (default: on the last rank when stdout is a
            terminal).

    Attributes:
        total_loss_dict: Losses accumulated since the last console line.
        report_memory_flag: A memory report is still due at the next console line.
        history_wct: Wall-clock seconds since the job started, per recent iteration.
    """

    def __init__(
        self, state: Any, *, seq_length: int | None = None, progress: bool | None = None
    ) -> None:
        cfg = state.cfg
        logger_cfg = cfg.logger
        self.seq_length = seq_length or int(getattr(cfg.model, "seq_length", 0) or 0) or None
        window = max(
            state.metric_writers.report_settings.throughput_window_size or 0,
            getattr(logger_cfg, "throughput_window_size", None) or 0,
            logger_cfg.log_interval,
        )
        # bridge.logging reads at most window + 1 timestamps.
        self.history_wct: collections.deque[float] = collections.deque(maxlen=window + 1)
        self.total_loss_dict: dict[str, Any] = {}
        self.report_memory_flag = True
        self.log_params_norm = bool(logger_cfg.log_params_norm)
        self.moe = bool(moe_track_names(cfg.model))
        self.tensorboard_interval = int(logger_cfg.tensorboard_log_interval)
        total = _total_iterations(cfg)
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
        state = context.state
        cfg = state.cfg
        self.history_wct.append(time.time() - state.start_time)
        learning_rate, decoupled_learning_rate = learning_rates(context.optimizer)
        params_norm = (
            calc_params_l2_norm(context.model, cfg.model) if self.log_params_norm else None
        )
        if self.moe:
            # Every rank (the reduction is collective); written at TensorBoard intervals.
            from bridge.train.loop.batch_size import get_num_microbatches

            writers = state.metric_writers
            due = context.iteration % self.tensorboard_interval == 0
            report_moe_metrics(
                cfg.model,
                context.iteration,
                get_num_microbatches(),
                writers if writers.enabled and due else None,
                self.total_loss_dict,
            )
        self.report_memory_flag = training_log(
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
            cfg,
            state,
            self.history_wct,
            context.model,
            loaded_iteration=state.loaded_iteration,
            seq_length=self.seq_length,
        )
        if self.progress.enabled and "lm loss" in result.losses:
            self.progress.update(context.iteration, {"lm loss": float(result.losses["lm loss"])})
        else:
            self.progress.update(context.iteration)

    def close(self) -> None:
        """Close the progress display (idempotent; also after an error)."""
        self.progress.close()
