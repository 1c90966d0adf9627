"""Evaluation: loss (and perplexity) over ``train.eval_iters`` batches of a split.

:func:`evaluate` runs the engine's schedule with ``forward_only=True`` over ``eval_iters``
global batches (``train.global_batch_size`` samples each, split into micro-batches like a
training iteration), averages each reported loss over tokens of all micro-batches,
iterations and data-parallel ranks, and puts the model back in training mode.
:func:`evaluate_and_print_results` logs the result through bridge.logging's validation
logger (console block on the last rank; ``<loss> validation`` / ``<loss> validation ppl``
metrics).
"""

from __future__ import annotations

import functools
import gc
import math
from collections.abc import Callable
from typing import Any

import torch

from bridge.logging import log_validation_results
from bridge.train.loop.losses import reduce_loss_dicts
from bridge.train.loop.state_injection import prepare_forward_step_func
from bridge.train.state import ForwardStepCallable, GlobalState
from core_utils.distributed import global_rank, global_world_size

__all__ = ["evaluate", "evaluate_and_print_results"]


def _data_parallel_layout() -> tuple[int, Any, bool]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1, None, True
    return (
        ps.get_data_parallel_world_size(),
        ps.get_data_parallel_group(with_context_parallel=True),
        bool(ps.is_pipeline_last_stage(ignore_virtual=True)),
    )


def _is_last_rank() -> bool:
    return global_rank() == global_world_size() - 1


def evaluate(
    state: GlobalState,
    forward_step_func: ForwardStepCallable,
    data_iterator: Any,
    model: list[torch.nn.Module],
    process_non_loss_data_func: Callable[..., Any] | None,
    config: Any,
    verbose: bool = False,
    non_loss_data_func: Callable[..., Any] | None = None,
    *,
    is_validation: bool = True,
) -> tuple[dict[str, float], Any, bool]:
    """Average the losses of ``train.eval_iters`` forward-only batches.

    Collective (every rank of the job). With ``train.manual_gc`` and
    ``train.manual_gc_eval`` the garbage collector runs before and after. Validation
    batches advance ``train_state.consumed_valid_samples`` (so a resumed run continues
    with the same validation samples).

    Args:
        state: The global state (fault-tolerance eval hooks, counters).
        forward_step_func: The forward step (the state is injected if it asks for it).
        data_iterator: Iterator over the split's micro-batches.
        model: Model chunks.
        process_non_loss_data_func: When given (and ``non_loss_data_func`` is not), the
            schedule collects what the loss function returns with ``non_loss_data=True``
            on one extra batch.
        config: The config (``train`` section: ``eval_iters``, batch sizes).
        verbose: Print each evaluation iteration on rank 0.
        non_loss_data_func: Called as ``non_loss_data_func(model)`` to compute non-loss
            data (takes precedence over collecting it through the schedule).
        is_validation: Count the samples in ``consumed_valid_samples`` (false for test).

    Returns:
        ``(losses, collected non-loss data or None, time limit hit)``; losses map each
        reported name to its token average. The time-limit flag is always False here: the
        exit conditions are checked after evaluation by the training loop.
    """
    train = config.train
    assert train is not None and train.micro_batch_size is not None
    dp_size, dp_cp_group, last_stage = _data_parallel_layout()
    gbs = int(train.global_batch_size or train.micro_batch_size * dp_size)
    num_microbatches = max(gbs // (train.micro_batch_size * dp_size), 1)
    seq_length = int(getattr(config.model, "seq_length", 0) or 0)
    step_func = prepare_forward_step_func(forward_step_func, state)
    forward_backward_func = state.forward_backward_func
    manual_gc = bool(train.manual_gc and train.manual_gc_eval)

    for chunk in model:
        chunk.eval()
    if manual_gc:
        gc.collect()
    run_forward = functools.partial(
        forward_backward_func,
        forward_step_func=step_func,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=train.micro_batch_size,
        decoder_seq_length=seq_length,
        forward_only=True,
    )
    totals: dict[str, list[float]] = {}
    collected: Any = None
    try:
        with torch.no_grad():
            for iteration in range(int(train.eval_iters)):
                if verbose and torch.distributed.get_rank() == 0:
                    print(f"Evaluating iter {iteration + 1}/{train.eval_iters}", flush=True)
                state.fault_tolerance.on_eval_step_start()
                loss_dicts = run_forward()
                state.fault_tolerance.on_eval_step_end()
                if last_stage:
                    for name, (value, count) in reduce_loss_dicts(loss_dicts, dp_cp_group).items():
                        pair = totals.setdefault(name, [0.0, 0.0])
                        pair[0] += value
                        pair[1] += count
                if is_validation:
                    state.train_state.consumed_valid_samples += num_microbatches * (
                        train.micro_batch_size * dp_size
                    )
            if non_loss_data_func is not None:
                collected = non_loss_data_func(model)
            elif process_non_loss_data_func is not None and last_stage:
                collected = run_forward(collect_non_loss_data=True)
    finally:
        for chunk in model:
            chunk.train()
        if manual_gc:
            gc.collect()
    losses = {name: value / max(count, 1.0) for name, (value, count) in totals.items()}
    return losses, collected, False


def evaluate_and_print_results(
    state: GlobalState,
    prefix: str,
    forward_step_func: ForwardStepCallable,
    data_iterator: Any,
    model: list[torch.nn.Module],
    config: Any,
    verbose: bool = False,
    write_to_tensorboard: bool = True,
    process_non_loss_data_func: Callable[..., Any] | None = None,
    non_loss_data_func: Callable[..., Any] | None = None,
    *,
    split: str = "validation",
) -> dict[str, float]:
    """Evaluate, then print the losses and perplexities and write them to the metric writers.

    Collective. The console block (``<split> loss at <prefix> | lm loss value: ... | lm loss
    PPL: ... |``) is printed by the last rank; with ``write_to_tensorboard`` the metrics go
    to every configured backend (``<loss> <split>``, and ``<loss> <split> ppl`` with
    ``logger.log_validation_ppl_to_tensorboard``), see
    :func:`bridge.logging.log_validation_results`.

    Args:
        state: The global state.
        prefix: Where the evaluation happened, e.g. ``"iteration 100"``.
        forward_step_func: The forward step.
        data_iterator: Iterator over the split.
        model: Model chunks.
        config: The config.
        verbose: Print each evaluation iteration.
        write_to_tensorboard: Write the metrics (else only print them).
        process_non_loss_data_func: Called as ``(collected, iteration, tensorboard writer)``
            on the last rank with the collected non-loss data.
        non_loss_data_func: See :func:`evaluate`.
        split: ``"validation"`` or ``"test"`` (names the line and the metrics).

    Returns:
        The averaged losses.
    """
    losses, collected, _ = evaluate(
        state,
        forward_step_func,
        data_iterator,
        model,
        process_non_loss_data_func,
        config,
        verbose,
        non_loss_data_func,
        is_validation=split == "validation",
    )
    iteration = state.train_state.step
    if write_to_tensorboard:
        log_validation_results(prefix, losses, iteration, state, split=split)
    elif _is_last_rank():
        line = f" {split} loss at {prefix} | " + "".join(
            f"{k} value: {v:.6E} | {k} PPL: {math.exp(min(20.0, v)):.6E} | "
            for k, v in losses.items()
        )
        print(line, flush=True)
    if process_non_loss_data_func is not None and collected is not None:
        writer = state.metric_writers.tensorboard
        if writer is not None:
            process_non_loss_data_func(collected, iteration, writer)
    return losses
