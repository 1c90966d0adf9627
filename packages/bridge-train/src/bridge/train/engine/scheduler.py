"""Build megatron-core's ``OptimizerParamScheduler`` from the scheduler and optimizer configs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from bridge.config import (
    ConfigError,
    OptimizerConfigProtocol,
    SchedulerConfig,
    TrainingConfig,
    scheduler_steps as derive_scheduler_steps,
)

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer

__all__ = ["build_optimizer_param_scheduler", "scheduler_steps"]


def scheduler_steps(
    scheduler_config: SchedulerConfig, train_config: TrainingConfig | None
) -> dict[str, int | None]:
    """Warm-up, decay, weight-decay and WSD lengths in samples, as megatron counts them.

    The ``*_steps`` fields ``ConfigContainer.validate()`` fills are used as they are; a
    section that was never validated (the MIMO recipe's) gets them from
    ``bridge.config.scheduler_steps``, the derivation ``validate()`` uses.

    Returns:
        ``{"lr_warmup_steps", "lr_decay_steps", "wd_incr_steps", "wsd_decay_steps"}``.

    Raises:
        ValueError: The lengths cannot be derived (no ``train_iters`` / ``global_batch_size``)
            or are inconsistent (warm-up not shorter than the decay).
    """
    names = ("lr_warmup_steps", "lr_decay_steps", "wd_incr_steps", "wsd_decay_steps")
    if scheduler_config.lr_decay_steps is not None:
        return {name: getattr(scheduler_config, name) for name in names}
    steps = derive_scheduler_steps(scheduler_config, train_config)
    if steps is None:
        raise ConfigError(
            "scheduler",
            "the decay length is unknown; set train.train_iters (or train.train_samples, "
            "scheduler.lr_decay_iters)",
        )
    return steps


def build_optimizer_param_scheduler(
    optimizer: MegatronOptimizer,
    optimizer_config: OptimizerConfigProtocol,
    scheduler_config: SchedulerConfig,
    train_config: TrainingConfig | None = None,
) -> OptimizerParamScheduler:
    """megatron-core's ``OptimizerParamScheduler`` for ``optimizer``.

    The scheduler counts samples (advance it with ``scheduler.step(global_batch_size)``
    each iteration); the weight decay the scheduler section leaves unset is
    ``optimizer_config.weight_decay``. Note megatron's ``load_state_dict`` adds the saved
    step count to the current one: load only into a freshly built scheduler.

    Returns:
        The scheduler, already applied once (step 0).

    Raises:
        ValueError: Underivable schedule lengths.
    """
    steps = scheduler_steps(scheduler_config, train_config)
    # The launch checks refused learning rates megatron cannot schedule
    # (bridge.config.check_learning_rates) and a WSD decay without its length (the section).
    start_wd, end_wd = scheduler_config.start_weight_decay, scheduler_config.end_weight_decay
    start_wd = optimizer_config.weight_decay if start_wd is None else start_wd
    end_wd = optimizer_config.weight_decay if end_wd is None else end_wd
    return OptimizerParamScheduler(
        optimizer,
        init_lr=float(scheduler_config.lr_warmup_init or 0.0),
        max_lr=optimizer_config.lr,
        min_lr=optimizer_config.min_lr or 0.0,
        lr_decay_style=scheduler_config.lr_decay_style,
        start_wd=start_wd,
        end_wd=end_wd,
        wd_incr_style=scheduler_config.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=scheduler_config.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=scheduler_config.override_opt_param_scheduler,
        lr_wsd_decay_style=scheduler_config.lr_wsd_decay_style,
        **steps,  # lr_warmup_steps, lr_decay_steps, wd_incr_steps, wsd_decay_steps
    )
