"""The loop's standard components, built from their sections, in the order they run."""

from __future__ import annotations

from pathlib import Path

import torch

from bridge.config import CheckpointConfig, ProfilingConfig, SamplesConfig, TrainingConfig
from bridge.logging import MetricWriters
from bridge.resiliency import NullFaultTolerance, RunResiliency
from bridge.resiliency.loop_components import (
    FaultToleranceHeartbeat,
    NVRxStragglerPoll,
    StragglerReporter,
)
from bridge.train.data.tokenizers import Tokenizer
from bridge.train.loop.components.checkpointer import Checkpointer, SaveFunction
from bridge.train.loop.components.evaluation import EvaluateFunction, Evaluator
from bridge.train.loop.components.maintenance import (
    DeviceSync,
    GarbageCollection,
    WeightHashCheck,
)
from bridge.train.loop.components.profiler import Profiler
from bridge.train.loop.profiling import should_profile_rank
from core_utils import Timers
from core_utils.callbacks import Callback, CallbackList

__all__ = ["close_components", "loop_callback_list", "standard_components"]


def standard_components(
    *,
    metrics: Callback,
    train: TrainingConfig,
    log_interval: int,
    checkpoint: CheckpointConfig | None,
    save: SaveFunction | None,
    resiliency: RunResiliency,
    profiling: ProfilingConfig | None = None,
    profile_trace_dir: Path | None = None,
    evaluate: EvaluateFunction | None = None,
    timers: Timers | None = None,
    toggle_forward_pre_hooks: bool = False,
    samples: SamplesConfig | None = None,
    tokenizer: Tokenizer | None = None,
    seq_length: int | None = None,
    metric_writers: MetricWriters | None = None,
) -> list[Callback]:
    """The components a training run needs, each built from its own section.

    Order (each hook runs them in this order): metrics, the fault-tolerance heartbeat,
    device sync, straggler report, weight-hash check, profiler, garbage collection, NVRx
    straggler poll, evaluation, sample completions (after validation, ``samples``),
    checkpointer (saves and exit decisions last, so a checkpoint holds everything the step
    did). A feature that is off adds no component, so it costs nothing per step.
    :func:`loop_callback_list` puts the user's callbacks between the two groups. GPT
    training and the MIMO recipe build their lists here; they differ in the metrics
    component, the save function and whether they evaluate.

    Args:
        metrics: The run's metrics component (GPT:
            :class:`~bridge.train.loop.components.MetricsProcessor`).
        train: The ``train`` section (sync, weight-hash, GC and evaluation intervals).
        log_interval: ``logger.log_interval`` (straggler reports).
        checkpoint: The ``checkpoint`` section (``None``: never save).
        save: Writes a checkpoint (see :data:`SaveFunction`; ``None``: never saves).
        resiliency: The run's fault tolerance, straggler detection and exit conditions.
        profiling: The ``profiling`` section (``None``: no profiler).
        profile_trace_dir: Where the torch profiler writes.
        evaluate: Validation (``None``: none, e.g. without a validation split).
        timers: The run's timers (evaluation pauses ``interval-time``).
        toggle_forward_pre_hooks: Disable forward pre-hooks around whole-parameter reads.
        samples: The ``samples`` section (``None``: no sample completions; they follow
            validation, so ``evaluate`` is needed too).
        tokenizer: The run's tokenizer (needed by the ``samples`` section).
        seq_length: The model's sequence length (needed by the ``samples`` section).
        metric_writers: The run's metric writers (the ``samples`` section records its
            completions there).

    Returns:
        The components, to pass to :func:`loop_callback_list`.
    """
    components: list[Callback] = [metrics]
    if not isinstance(resiliency.fault_tolerance, NullFaultTolerance):
        components.append(FaultToleranceHeartbeat(resiliency.fault_tolerance))
    if train.train_sync_interval and torch.cuda.is_available():
        components.append(DeviceSync(train.train_sync_interval))
    if resiliency.straggler_timing.configured:
        components.append(StragglerReporter(resiliency.straggler_timing, log_interval))
    if train.check_weight_hash_across_dp_replicas_interval:
        components.append(
            WeightHashCheck(
                train.check_weight_hash_across_dp_replicas_interval, toggle_forward_pre_hooks
            )
        )
    if profiling is not None and should_profile_rank(profiling):
        components.append(Profiler(profiling, profile_trace_dir))
    if train.manual_gc:
        components.append(GarbageCollection(train.manual_gc_interval))
    if resiliency.nvrx_straggler is not None:
        components.append(NVRxStragglerPoll(resiliency.nvrx_straggler))
    if evaluate is not None and train.eval_interval:
        components.append(Evaluator(evaluate, train.eval_interval, timers))
        if samples is not None:
            from bridge.train.loop.components.samples import GenerationSamples

            if tokenizer is None or seq_length is None:
                raise ValueError(
                    "standard_components: the samples section needs the tokenizer and the "
                    "model's seq_length"
                )
            components.append(
                GenerationSamples(
                    samples,
                    tokenizer,
                    int(seq_length),
                    toggle_forward_pre_hooks=toggle_forward_pre_hooks,
                    metric_writers=metric_writers,
                )
            )
    components.append(
        Checkpointer.from_config(
            checkpoint,
            save,
            exit_conditions=resiliency.exit_conditions,
            fault_tolerance=resiliency.fault_tolerance,
        )
    )
    return components


#: Components that act on a finished iteration (evaluate it, save it, decide to stop): they
#: run after the user's callbacks, whose ``on_step_end`` thus sees the step first.
_AFTER_CALLBACKS = (Evaluator, Checkpointer)


def loop_callback_list(components: list[Callback], callbacks: list[Callback]) -> CallbackList:
    """The loop's :class:`core_utils.CallbackList`: ``components`` with the user's
    ``callbacks`` placed before evaluation and the checkpointer.

    So at every step: metrics, heartbeat, ..., then the user's ``on_step_end``, then
    evaluation (``on_validation_start``/``_end``) and the checkpointer (``on_save``). At the
    end: the user's ``on_train_end``, then the final save (``on_save``).

    Args:
        components: From :func:`standard_components`.
        callbacks: The user's callbacks, in order.

    Returns:
        The list to put on the :class:`core_utils.loop.LoopContext`.
    """
    before = [c for c in components if not isinstance(c, _AFTER_CALLBACKS)]
    after = [c for c in components if isinstance(c, _AFTER_CALLBACKS)]
    return CallbackList(before, callbacks, after=after)


def close_components(components: list[Callback]) -> None:
    """Call ``close()`` of every component that has one (profiler, GC, progress display),
    in order; each is idempotent and safe after an error."""
    for component in components:
        close = getattr(component, "close", None)
        if close is not None:
            close()
