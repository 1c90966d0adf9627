"""Build megatron-core's ``OptimizerParamScheduler`` from the scheduler and optimizer configs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from bridge.config import OptimizerConfigProtocol, SchedulerConfig, TrainingConfig

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer

__all__ = ["build_optimizer_param_scheduler", "scheduler_steps"]


def scheduler_steps(
    scheduler_config: SchedulerConfig, train_config: TrainingConfig | None
) -> dict[str, int | None]:
    """Warm-up, decay, weight-decay and WSD lengths in samples, as megatron counts them.

    The ``*_steps`` fields ``ConfigContainer.validate()`` fills are used as they are; missing
    ones are derived the way it derives them (a section that was never validated: the MIMO
    recipe's).

    Returns:
        ``{"lr_warmup_steps", "lr_decay_steps", "wd_incr_steps", "wsd_decay_steps"}``.

    Raises:
        ValueError: The lengths cannot be derived (no ``train_iters`` / ``global_batch_size``)
            or are inconsistent (warm-up not shorter than decay).
    """

    sched = scheduler_config
    train_iters = getattr(train_config, "train_iters", None)
    gbs = getattr(train_config, "global_batch_size", None)

    def samples(iters: Any) -> int | None:
        if iters is None:
            return None
        if gbs is None:
            raise ValueError(
                "train.global_batch_size is needed to turn scheduler iterations into samples"
            )
        return int(iters) * int(gbs)

    train_samples = getattr(train_config, "train_samples", None)
    by_samples = train_samples is not None
    decay_steps = sched.lr_decay_steps
    if decay_steps is None:
        if by_samples:
            decay_steps = sched.lr_decay_samples or train_samples
        else:
            decay_steps = samples(sched.lr_decay_iters or train_iters)
    if decay_steps is None:
        raise ValueError(
            "scheduler: the decay length is unknown; set train.train_iters (or "
            "scheduler.lr_decay_iters / lr_decay_steps)"
        )
    warmup_steps = sched.lr_warmup_steps
    if warmup_steps is None:
        if sched.lr_warmup_fraction is not None:
            warmup_steps = int(float(sched.lr_warmup_fraction) * decay_steps)
        elif by_samples:
            warmup_steps = int(sched.lr_warmup_samples or 0)
        else:
            warmup_steps = samples(sched.lr_warmup_iters or 0)
    wd_steps = sched.wd_incr_steps
    if wd_steps is None:
        wd_steps = (train_samples if by_samples else samples(train_iters)) or decay_steps
    wsd_steps = sched.wsd_decay_steps
    if wsd_steps is None:
        wsd_steps = sched.lr_wsd_decay_samples if by_samples else samples(sched.lr_wsd_decay_iters)
    if decay_steps <= 0:
        raise ValueError(
            f"scheduler: the learning-rate decay length must be > 0 samples, got {decay_steps}"
        )
    assert warmup_steps is not None  # samples() of a number
    if warmup_steps >= decay_steps:
        raise ValueError(
            f"scheduler: warm-up ({warmup_steps} samples) must be shorter than the decay "
            f"({decay_steps} samples); lower scheduler.lr_warmup_iters / lr_warmup_fraction or "
            "raise scheduler.lr_decay_iters"
        )
    return {
        "lr_warmup_steps": int(warmup_steps),
        "lr_decay_steps": int(decay_steps),
        "wd_incr_steps": int(wd_steps),
        "wsd_decay_steps": None if wsd_steps is None else int(wsd_steps),
    }


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
        ValueError: Inconsistent or underivable schedule lengths, or bad learning rates.
    """
    steps = scheduler_steps(scheduler_config, train_config)
    lr = optimizer_config.lr
    min_lr = optimizer_config.min_lr if optimizer_config.min_lr is not None else 0.0
    init_lr = float(scheduler_config.lr_warmup_init or 0.0)
    if lr is None or lr < min_lr or init_lr > lr:
        raise ValueError(
            f"optimizer.lr={lr}, optimizer.min_lr={min_lr}, scheduler.lr_warmup_init={init_lr}: "
            "need lr set and min_lr <= lr, lr_warmup_init <= lr"
        )
    start_wd, end_wd = scheduler_config.start_weight_decay, scheduler_config.end_weight_decay
    start_wd = optimizer_config.weight_decay if start_wd is None else start_wd
    end_wd = optimizer_config.weight_decay if end_wd is None else end_wd
    decay_style = scheduler_config.lr_decay_style
    if decay_style == "WSD" and steps["wsd_decay_steps"] is None:
        raise ValueError("scheduler.lr_decay_style='WSD' needs scheduler.lr_wsd_decay_iters")
    return OptimizerParamScheduler(
        optimizer,
        init_lr=init_lr,
        max_lr=lr,
        min_lr=min_lr,
        lr_warmup_steps=steps["lr_warmup_steps"],
        lr_decay_steps=steps["lr_decay_steps"],
        lr_decay_style=decay_style,
        start_wd=start_wd,
        end_wd=end_wd,
        wd_incr_steps=steps["wd_incr_steps"],
        wd_incr_style=scheduler_config.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=scheduler_config.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=scheduler_config.override_opt_param_scheduler,
        wsd_decay_steps=steps["wsd_decay_steps"],
        lr_wsd_decay_style=scheduler_config.lr_wsd_decay_style,
    )
