"""A minimal training loop over the engine seam (reference loop and benchmark baseline).

:func:`train_steps` is the smallest loop that trains correctly with the engine: zero the
gradient buffers, run the engine's ``forward_backward_func`` over the micro-batches, step
the optimizer, advance the scheduler by the global batch size (megatron counts samples),
and average the reported loss over tokens of all micro-batches and data-parallel ranks.
:func:`run_bare_loop` builds everything it needs from configs first. The full trainer
(``bridge.train.train``) adds evaluation, checkpoints, logging and exit handling around the
same calls; benchmarks time this loop as their baseline. It shares the step's pieces with
the trainer (:mod:`bridge.train.loop.losses`, the
:class:`~core_utils.loop.StepResult` and the ``train_state`` update).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from bridge.config import RNGConfig
from bridge.train.engine.megatron import Engine, build_engine
from bridge.train.loop.losses import sum_loss_pairs, zero_grad_buffers
from bridge.train.loop.state_injection import prepare_forward_step_func
from bridge.train.loop.step import data_parallel_layout
from bridge.train.models.gpt_step import forward_step
from bridge.train.models.layout_init import layout_independent_seed
from bridge.train.state import GlobalState, TrainState
from core_utils.loop import StepResult, advance_train_state

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from bridge.config import (
        DDPConfigProtocol,
        DistributedInitConfig,
        OptimizerConfigProtocol,
        SchedulerConfig,
        TrainingConfig,
    )

__all__ = ["BareLoopResult", "run_bare_loop", "train_steps"]


@dataclass
class BareLoopResult:
    """Per-iteration results of :func:`train_steps` (identical on every rank).

    Attributes:
        losses: Token-averaged ``lm loss`` of each iteration (over the global batch).
        grad_norms: Gradient norm each iteration reported (``None`` if skipped).
        learning_rates: Learning rate used by each iteration.
        update_successful: Whether each iteration's update was applied.
        num_tokens: Loss tokens of each iteration's global batch.
    """

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float | None] = field(default_factory=list)
    learning_rates: list[float] = field(default_factory=list)
    update_successful: list[bool] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)


def train_steps(
    engine: Engine,
    model: list[torch.nn.Module],
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    data_iterator: Iterator[Any],
    *,
    train_iters: int,
    global_batch_size: int,
    micro_batch_size: int,
    seq_length: int,
    forward_step_func: Callable[..., Any] = forward_step,
    train_state: TrainState | None = None,
    on_step: Callable[[int, BareLoopResult], None] | None = None,
) -> BareLoopResult:
    """Run ``train_iters`` training iterations.

    Args:
        engine: The engine the model and optimizer were built with.
        model: Model chunks from ``engine.setup_model``.
        optimizer: Optimizer from ``engine.setup_optimizer``.
        scheduler: Scheduler from ``engine.setup_optimizer``.
        data_iterator: Iterator over micro-batches for this rank.
        train_iters: Iterations to run.
        global_batch_size: Samples per iteration over all data-parallel ranks.
        micro_batch_size: Samples per micro-batch per rank.
        seq_length: Sequence length.
        forward_step_func: Forward step; one that asks for the ``GlobalState`` gets a fresh
            one (its timers time the batch fetch, as the trainer's do).
        train_state: The counters to advance (a fresh ``TrainState`` by default), e.g. the
            one a data iterator was positioned with.
        on_step: Called after every iteration with ``(iteration, result_so_far)``.

    Returns:
        The per-iteration results.

    Raises:
        ValueError: ``global_batch_size`` is not a multiple of
            ``micro_batch_size x data_parallel_size``.
    """
    dp_size, dp_cp_group, _ = data_parallel_layout()
    if global_batch_size % (micro_batch_size * dp_size):
        raise ValueError(
            f"train.global_batch_size={global_batch_size} is not a multiple of "
            f"train.micro_batch_size={micro_batch_size} x data-parallel size {dp_size}"
        )
    num_microbatches = global_batch_size // (micro_batch_size * dp_size)
    train_state = train_state if train_state is not None else TrainState()
    step_func = prepare_forward_step_func(forward_step_func, GlobalState())
    result = BareLoopResult()
    for _ in range(train_iters):
        zero_grad_buffers(model, optimizer)
        loss_dicts = engine.forward_backward_func(
            forward_step_func=step_func,
            data_iterator=data_iterator,
            model=model,
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            decoder_seq_length=seq_length,
            forward_only=False,
        )
        learning_rate = float(optimizer.param_groups[0]["lr"])
        ok, grad_norm, num_zeros = optimizer.step()
        if ok:
            scheduler.step(increment=global_batch_size)
        pairs = sum_loss_pairs(loss_dicts, dp_cp_group)
        step = StepResult(
            losses={name: pair[0] / pair[1].clamp(min=1.0) for name, pair in pairs.items()},
            skipped=not ok,
            grad_norm=grad_norm,
            num_zeros_in_grad=num_zeros,
            num_samples=global_batch_size,
        )
        loss = step.losses.get("lm loss")
        result.losses.append(float("nan") if loss is None else float(loss))
        result.num_tokens.append(int(pairs["lm loss"][1]) if "lm loss" in pairs else 1)
        result.grad_norms.append(None if grad_norm is None else float(grad_norm))
        result.learning_rates.append(learning_rate)
        result.update_successful.append(bool(ok))
        advance_train_state(train_state, step)
        if on_step is not None:
            on_step(train_state.step, result)
    return result


def run_bare_loop(
    model_provider: Any,
    optimizer_config: OptimizerConfigProtocol,
    scheduler_config: SchedulerConfig,
    train_config: TrainingConfig,
    data_iterator_factory: Callable[[TrainState], Iterator[Any]],
    *,
    ddp_config: DDPConfigProtocol | None = None,
    dist_config: DistributedInitConfig | None = None,
    rng_config: RNGConfig | None = None,
    engine: Engine | None = None,
    forward_step_func: Callable[..., Any] = forward_step,
) -> BareLoopResult:
    """Initialise, build model/optimizer/scheduler, and run :func:`train_steps`.

    Args:
        model_provider: A provider that is also the model config (``GPTModelProvider``).
        optimizer_config: megatron's ``OptimizerConfig``.
        scheduler_config: ``SchedulerConfig``.
        train_config: The ``train`` section (``train_iters``, ``global_batch_size``,
            ``micro_batch_size``).
        data_iterator_factory: Called once, after the parallel state exists, with the run's
            ``TrainState`` (the samplers' position); returns this rank's micro-batch iterator.
        ddp_config: Data-parallel config (defaults when None).
        dist_config: ``DistributedInitConfig`` (defaults when None).
        rng_config: ``RNGConfig`` (its defaults when None): the seed and
            ``layout_independent_init``, resolved as the trainer resolves them.
        engine: The engine (default: :func:`~bridge.train.engine.build_engine`'s).
        forward_step_func: Forward step.

    Returns:
        The per-iteration results.

    Raises:
        ValueError: ``train_config`` leaves the iteration count or a batch size unset.
    """
    iters, global_batch, micro_batch = (
        train_config.train_iters,
        train_config.global_batch_size,
        train_config.micro_batch_size,
    )
    if iters is None or global_batch is None or micro_batch is None:
        raise ValueError(
            "run_bare_loop needs train.train_iters, train.global_batch_size and "
            "train.micro_batch_size set (the baseline has no sample-based schedule)"
        )
    eng = build_engine() if engine is None else engine
    rng = RNGConfig() if rng_config is None else rng_config
    eng.initialize_distributed(model_provider, dist_config, rng)
    # The trainer's initialisation (rng.layout_independent_init), so both loops train the
    # same weights and a benchmark can compare their losses as well as their step times.
    model = eng.setup_model(
        model_provider,
        ddp_config,
        layout_independent_seed=layout_independent_seed(rng, model_provider),
        align_grad_reduce=bool(getattr(dist_config, "align_grad_reduce", True)),
    )
    optimizer, scheduler = eng.setup_optimizer(
        model, optimizer_config, scheduler_config, train_config
    )
    train_state = TrainState()
    iterator = data_iterator_factory(train_state)
    return train_steps(
        eng,
        model,
        optimizer,
        scheduler,
        iterator,
        train_iters=iters,
        global_batch_size=global_batch,
        micro_batch_size=micro_batch,
        seq_length=model_provider.seq_length,
        forward_step_func=forward_step_func,
        train_state=train_state,
    )
