"""Megatron-Bridge's evaluation functions, as thin adapters over
:class:`~bridge.train.loop.eval.Evaluation` (what the loop's evaluator runs); they take the
``GlobalState`` and the config, as Megatron-Bridge's do, the evaluation only its sections.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from bridge.config import ConfigContainer
from bridge.train.loop.training import RunComponents
from bridge.train.state import ForwardStepCallable, GlobalState

__all__ = ["evaluate", "evaluate_and_print_results"]


def evaluate(
    state: GlobalState,
    forward_step_func: ForwardStepCallable,
    data_iterator: Any,
    model: list[torch.nn.Module],
    process_non_loss_data_func: Callable[..., Any] | None,
    config: ConfigContainer,
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
    # The sections of the config given, as the reference reads them.
    evaluation = RunComponents(
        state,
        forward_step_func,
        process_non_loss_data_func=process_non_loss_data_func,
        non_loss_data_func=non_loss_data_func,
        config=config,
    ).evaluation
    return evaluation.evaluate(data_iterator, model, verbose=verbose, is_validation=is_validation)


def evaluate_and_print_results(
    state: GlobalState,
    prefix: str,
    forward_step_func: ForwardStepCallable,
    data_iterator: Any,
    model: list[torch.nn.Module],
    config: ConfigContainer,
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
    # The sections of the config given, as the reference reads them.
    evaluation = RunComponents(
        state,
        forward_step_func,
        process_non_loss_data_func=process_non_loss_data_func,
        non_loss_data_func=non_loss_data_func,
        config=config,
    ).evaluation
    return evaluation.evaluate_and_log(
        prefix,
        data_iterator,
        model,
        verbose=verbose,
        write_to_tensorboard=write_to_tensorboard,
        split=split,
    )
