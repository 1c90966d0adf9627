"""Evaluation: loss (and perplexity) over ``train.eval_iters`` batches of a split.

The loop's :class:`~bridge.train.loop.components.Evaluator` and Megatron-Bridge's
``evaluate`` / ``evaluate_and_print_results`` (:mod:`bridge.train.api.eval`) run the one
:class:`Evaluation`: the engine's schedule with ``forward_only=True`` over ``eval_iters``
global batches, each loss averaged over the tokens of all micro-batches, iterations and
data-parallel ranks, logged through bridge.logging's validation logger. Separate
validation sets (``dataset.multiple_validation_sets``) are each evaluated and logged on their
own (:meth:`Evaluation.evaluate_sets_and_log`).
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bridge.config import TrainingConfig
from bridge.logging import LoggingState, log_validation_results, validation_line
from bridge.resiliency import FaultTolerance
from bridge.train.data.validation_sets import ValidationSets
from bridge.train.loop.forward_pre_hooks import disable_forward_pre_hook, enable_forward_pre_hook
from bridge.train.loop.losses import reduce_loss_dicts
from bridge.train.loop.step import data_parallel_layout
from bridge.train.state import ForwardStepCallable, TrainState
from core_utils.distributed import global_rank, global_world_size
from core_utils.loop import LoopContext

__all__ = ["Evaluation"]


@dataclass
class Evaluation:
    """Evaluates the model on a split and logs the result (see the module docstring).

    Attributes:
        forward_step_func: The forward step, state already injected if it asks for it
            (:func:`~bridge.train.loop.state_injection.prepare_forward_step_func`).
        forward_backward_func: The engine's schedule (run with ``forward_only=True``).
        train: The ``train`` section (``eval_iters``, batch sizes, ``manual_gc_eval``).
        seq_length: The model's sequence length.
        train_state: The run's counters (``consumed_valid_samples`` advance).
        state: The run's counters, timers and metric writers, for the logged results.
        fault_tolerance: Fault-tolerance hooks around every evaluation step.
        log_ppl: ``logger.log_validation_ppl_to_tensorboard``.
        process_non_loss_data_func: See :func:`evaluate_and_print_results`.
        non_loss_data_func: See :func:`evaluate`.
        toggle_forward_pre_hooks: Disable forward pre-hooks around the evaluation the loop
            runs (it must see whole parameters, not ones a pending overlapped all-gather
            would still overwrite).
    """

    forward_step_func: ForwardStepCallable
    forward_backward_func: Callable[..., Any]
    train: TrainingConfig
    seq_length: int
    train_state: TrainState
    state: LoggingState
    fault_tolerance: FaultTolerance
    log_ppl: bool = False
    process_non_loss_data_func: Callable[..., Any] | None = None
    non_loss_data_func: Callable[..., Any] | None = None
    toggle_forward_pre_hooks: bool = False

    def evaluate(
        self,
        data_iterator: Any,
        model: list[torch.nn.Module],
        *,
        verbose: bool = False,
        is_validation: bool = True,
        iterations: int | None = None,
    ) -> tuple[dict[str, float], Any, bool]:
        """:func:`evaluate`: ``(losses, collected non-loss data or None, False)``, over
        ``iterations`` global batches (default ``train.eval_iters``)."""
        train = self.train
        num_iterations = int(train.eval_iters) if iterations is None else int(iterations)
        assert train.micro_batch_size is not None
        dp_size, dp_cp_group, last_stage = data_parallel_layout()
        gbs = int(train.global_batch_size or train.micro_batch_size * dp_size)
        num_microbatches = max(gbs // (train.micro_batch_size * dp_size), 1)
        manual_gc = bool(train.manual_gc and train.manual_gc_eval)

        for chunk in model:
            chunk.eval()
        if manual_gc:
            gc.collect()
        run_forward = functools.partial(
            self.forward_backward_func,
            forward_step_func=self.forward_step_func,
            data_iterator=data_iterator,
            model=model,
            num_microbatches=num_microbatches,
            seq_length=self.seq_length,
            micro_batch_size=train.micro_batch_size,
            decoder_seq_length=self.seq_length,
            forward_only=True,
        )
        reported: list[dict[str, torch.Tensor]] = []
        collected: Any = None
        try:
            with torch.no_grad():
                for iteration in range(num_iterations):
                    if verbose and torch.distributed.get_rank() == 0:
                        print(f"Evaluating iter {iteration + 1}/{num_iterations}", flush=True)
                    self.fault_tolerance.on_eval_step_start()
                    reported += run_forward()
                    self.fault_tolerance.on_eval_step_end()
                    if is_validation:
                        self.train_state.consumed_valid_samples += num_microbatches * (
                            train.micro_batch_size * dp_size
                        )
                if self.non_loss_data_func is not None:
                    collected = self.non_loss_data_func(model)
                elif self.process_non_loss_data_func is not None and last_stage:
                    collected = run_forward(collect_non_loss_data=True)
        finally:
            for chunk in model:
                chunk.train()
            if manual_gc:
                gc.collect()
        # Summed over every micro-batch of every iteration, reduced over the ranks once.
        totals = reduce_loss_dicts(reported, dp_cp_group) if last_stage else {}
        losses = {name: value / max(count, 1.0) for name, (value, count) in totals.items()}
        return losses, collected, False

    def evaluate_and_log(
        self,
        prefix: str,
        data_iterator: Any,
        model: list[torch.nn.Module],
        *,
        verbose: bool = False,
        write_to_tensorboard: bool = True,
        split: str = "validation",
        iterations: int | None = None,
        counts_valid_samples: bool | None = None,
    ) -> dict[str, float]:
        """:func:`evaluate_and_print_results`: evaluate, then print the losses and
        perplexities (last rank) and, with ``write_to_tensorboard``, write them to every
        configured backend (:func:`bridge.logging.log_validation_results`); with collected
        non-loss data, ``process_non_loss_data_func(collected, iteration, tensorboard
        writer)`` runs on the last rank. ``iterations`` overrides ``train.eval_iters``;
        ``counts_valid_samples`` (default: ``split == "validation"``) advances
        ``consumed_valid_samples``."""
        if counts_valid_samples is None:
            counts_valid_samples = split == "validation"
        losses, collected, _ = self.evaluate(
            data_iterator,
            model,
            verbose=verbose,
            is_validation=counts_valid_samples,
            iterations=iterations,
        )
        iteration = self.state.train_state.step
        if write_to_tensorboard:
            log_validation_results(
                prefix, losses, iteration, self.state, split=split, log_ppl=self.log_ppl
            )
        elif global_rank() == global_world_size() - 1:
            print(validation_line(prefix, losses, split), flush=True)
        writer = self.state.metric_writers.tensorboard
        process = self.process_non_loss_data_func
        if process is not None and collected is not None and writer is not None:
            process(collected, iteration, writer)
        return losses

    def evaluate_sets_and_log(
        self, prefix: str, sets: ValidationSets, model: list[torch.nn.Module]
    ) -> dict[str, dict[str, float]]:
        """Evaluate and log each separate validation set on its own, as the split
        ``validation <name>`` (:mod:`bridge.train.data.validation_sets`): a full pass over
        each, or ``train.eval_iters`` global batches continuing where the last evaluation
        stopped.

        Returns:
            ``{"validation <name>": {loss name: value}}``, in the order of the sets.
        """
        results: dict[str, dict[str, float]] = {}
        for index, validation_set in enumerate(sets):
            split = f"validation {validation_set.name}"
            results[split] = self.evaluate_and_log(
                prefix,
                validation_set.batches(),
                model,
                split=split,
                iterations=validation_set.iterations,
                # Every set reads as many samples as the first, so the one counter is each
                # set's position; a full pass always starts at sample 0 and has none.
                counts_valid_samples=index == 0 and not sets.full_pass,
            )
        return results

    def __call__(self, context: LoopContext) -> None:
        """The loop's :data:`~bridge.train.loop.components.EvaluateFunction`: validation
        at ``context.iteration`` on the context's validation iterator."""
        model = context.model
        if self.toggle_forward_pre_hooks:
            disable_forward_pre_hook(model)
        prefix = f"iteration {context.iteration}"
        if isinstance(context.valid_data_iterator, ValidationSets):
            self.evaluate_sets_and_log(prefix, context.valid_data_iterator, model)
        else:
            self.evaluate_and_log(prefix, context.valid_data_iterator, model, verbose=False)
        if self.toggle_forward_pre_hooks:
            enable_forward_pre_hook(model)
