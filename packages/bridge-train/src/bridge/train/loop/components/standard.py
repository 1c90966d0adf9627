"""The loop's standard components, in the order they run after every step."""

from __future__ import annotations

from typing import Any

import torch

from bridge.resiliency import NullFaultTolerance
from bridge.resiliency.loop_components import (
    FaultToleranceHeartbeat,
    NVRxStragglerPoll,
    StragglerReporter,
)
from bridge.train.loop.components.checkpointer import (
    Checkpointer,
    FinalizeFunction,
    SaveFunction,
)
from bridge.train.loop.components.evaluation import EvaluateFunction, Evaluator
from bridge.train.loop.components.maintenance import (
    DeviceSync,
    GarbageCollection,
    WeightHashCheck,
)
from bridge.train.loop.components.metrics import MetricsProcessor
from bridge.train.loop.components.profiler import Profiler
from bridge.train.loop.profiling import should_profile_rank
from core_utils.callbacks import Callback, CallbackList

__all__ = ["loop_callback_list", "standard_components"]


def standard_components(
    state: Any,
    *,
    save: SaveFunction,
    finalize: FinalizeFunction | None = None,
    evaluate: EvaluateFunction | None = None,
    toggle_forward_pre_hooks: bool = False,
    seq_length: int | None = None,
    tokenizer: Any = None,
) -> list[Callback]:
    """The components a training run needs, as its config switches them on.

    Order (each hook runs them in this order): metrics (``training_log``), the
    fault-tolerance heartbeat, device sync, straggler report, weight-hash check, profiler,
    garbage collection, NVRx straggler poll, evaluation, sample completions (after
    validation, ``samples``), checkpointer (saves and exit decisions last, so a checkpoint
    holds everything the step did). A feature that is off
    adds no component, so it costs nothing per step. :func:`loop_callback_list` puts the
    user's callbacks between the two groups.

    Args:
        state: The run's ``GlobalState`` (config sections, resiliency objects).
        save: Writes a checkpoint (see :data:`SaveFunction`).
        finalize: Commits asynchronous saves (``None``: synchronous saves).
        evaluate: Validation (``None``: none).
        toggle_forward_pre_hooks: Disable forward pre-hooks around whole-parameter reads.
        seq_length: Tokens per sample for throughput metrics (default: the model's).
        tokenizer: The run's tokenizer (needed by the ``samples`` section).

    Returns:
        The components, to pass as ``CallbackList(components, user_callbacks)``.
    """
    cfg = state.cfg
    train = cfg.train
    components: list[Callback] = [MetricsProcessor(state, seq_length=seq_length)]
    if not isinstance(state.fault_tolerance, NullFaultTolerance):
        components.append(FaultToleranceHeartbeat(state.fault_tolerance))
    if train.train_sync_interval and torch.cuda.is_available():
        components.append(DeviceSync(train.train_sync_interval))
    if state.straggler_timing.configured:
        components.append(StragglerReporter(state.straggler_timing, cfg.logger.log_interval))
    if train.check_weight_hash_across_dp_replicas_interval:
        components.append(
            WeightHashCheck(
                train.check_weight_hash_across_dp_replicas_interval, toggle_forward_pre_hooks
            )
        )
    if cfg.profiling is not None and should_profile_rank(cfg.profiling):
        components.append(Profiler(cfg))
    if train.manual_gc:
        components.append(GarbageCollection(train.manual_gc_interval))
    if state.nvrx_straggler is not None:
        components.append(NVRxStragglerPoll(state.nvrx_straggler))
    if evaluate is not None and train.eval_interval:
        components.append(Evaluator(evaluate, train.eval_interval))
        if getattr(cfg, "samples", None) is not None:
            from bridge.train.loop.components.samples import GenerationSamples

            if tokenizer is None:
                raise ValueError("standard_components: the samples section needs the tokenizer")
            components.append(
                GenerationSamples(
                    cfg.samples,
                    tokenizer,
                    int(cfg.model.seq_length),
                    toggle_forward_pre_hooks=toggle_forward_pre_hooks,
                )
            )
    components.append(
        Checkpointer(save, cfg.checkpoint, exit_conditions=state.exit_conditions, finalize=finalize)
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
        components: From :func:`standard_components` (or a loop's own list).
        callbacks: The user's callbacks, in order.

    Returns:
        The list to put on the :class:`~bridge.train.loop.run_loop.LoopContext`.
    """
    before = [c for c in components if not isinstance(c, _AFTER_CALLBACKS)]
    after = [c for c in components if isinstance(c, _AFTER_CALLBACKS)]
    return CallbackList(before, callbacks, after=after)
