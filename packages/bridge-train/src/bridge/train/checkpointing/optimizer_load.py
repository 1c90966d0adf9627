"""Restoring the optimizer and its scheduler from a checkpoint.

The scheduler's settings are compared with the checkpoint's before anything is loaded
(:func:`check_scheduler_settings`). The optimizer state is then loaded, converted first when
another kind of optimizer saved it (see
:mod:`~bridge.train.checkpointing.optimizer_conversion`), with each parameter group's
learning-rate and weight-decay bounds taken from the config or from the checkpoint as the
scheduler settings say (:func:`load_optimizer`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from bridge.train.checkpointing.errors import CheckpointError
from bridge.train.checkpointing.optimizer_conversion import (
    OptimizerConversion,
    converted_optimizer_state,
    saved_param_groups,
)
from bridge.train.checkpointing.state_dict import (
    META_KEY,
    distributed_parts,
    optimizer_format,
    optimizer_parts,
)
from core_utils.distributed import global_rank

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

__all__ = [
    "check_scheduler_settings",
    "checkpoint_group_bounds",
    "load_optimizer",
]

logger = logging.getLogger(__name__)

# Scheduler settings megatron's OptimizerParamScheduler checks against a checkpoint.
_SCHEDULER_SETTINGS = (
    "max_lr",
    "min_lr",
    "lr_warmup_steps",
    "lr_decay_steps",
    "lr_decay_style",
    "start_wd",
    "end_wd",
    "wd_incr_steps",
    "wd_incr_style",
)


def check_scheduler_settings(
    scheduler: OptimizerParamScheduler, saved: dict[str, Any], path: str
) -> None:
    """Refuse a checkpoint whose schedule differs from the config's, unless the config says
    which one wins; take the checkpoint's schedule lengths when only those differ.

    Runs before the optimizer state is loaded: megatron's optimizers pair the saved parameter
    groups with the current ones by their learning-rate bounds, so a run with another
    ``optimizer.lr`` would otherwise fail inside megatron-core instead of with this message.
    """
    if getattr(scheduler, "override_opt_param_scheduler", False) or getattr(
        scheduler, "use_checkpoint_opt_param_scheduler", False
    ):
        return  # the config says which schedule wins
    changed = [
        name
        for name in _SCHEDULER_SETTINGS
        if name in saved and getattr(scheduler, name, saved[name]) != saved[name]
    ]
    differing = "; ".join(
        f"{name} (config {getattr(scheduler, name)!r}, checkpoint {saved[name]!r})"
        for name in changed
    )
    if changed and set(changed) <= {"lr_decay_steps", "wd_incr_steps", "lr_warmup_steps"}:
        # Only the schedule's lengths differ: the run was extended (or shortened) with
        # train.train_iters. The checkpoint's schedule keeps the learning rate
        # continuous (after its decay ends it stays at min_lr); stretching it to the new
        # length would jump the learning rate back up, so that is left to an explicit
        # scheduler.override_opt_param_scheduler=true.
        # INFO: extending a run is what the user asked for, not a problem.
        log = logger.info if global_rank() == 0 else logger.debug
        log(
            "the schedule lengths differ from %s (%s): keeping the checkpoint's schedule "
            "(the learning rate stays at min_lr once its decay ends); set "
            "scheduler.override_opt_param_scheduler=true to stretch it to this run's length",
            path,
            differing,
        )
        for name in changed:
            setattr(scheduler, name, saved[name])
    elif changed:
        raise CheckpointError(
            f"the scheduler settings differ from those saved in {path}: {differing}. Set "
            "scheduler.override_opt_param_scheduler=True to keep the config's values, or "
            "scheduler.use_checkpoint_opt_param_scheduler=True to take the checkpoint's"
        )


# Learning-rate and weight-decay bounds megatron's scheduler reads from each parameter group.
_SCHEDULE_BOUNDS = ("max_lr", "min_lr", "start_wd", "end_wd")

# What pairs a saved parameter group with one of this run's: megatron's group key less the
# schedule bounds (which a run may change) and, across a conversion, less
# ``is_expert_parallel`` (expert parameters are grouped apart only when EP > 1).
_GROUP_IDENTITY = ("wd_mult", "lr_mult", "is_decoupled_lr")


def _schedule_bounds(group: dict[str, Any]) -> dict[str, Any]:
    """The learning-rate and weight-decay bounds a parameter group holds."""
    return {key: group[key] for key in _SCHEDULE_BOUNDS if key in group}


def _saved_counterparts(
    group: dict[str, Any], saved_groups: list[dict[str, Any]], *, converted: bool
) -> list[dict[str, Any]]:
    """The saved parameter groups paired with this run's ``group``: those equal to it in
    megatron's group key less the schedule bounds (and less ``is_expert_parallel`` when
    ``converted``). The one pairing rule of a load; none or several are for the caller to
    skip or refuse."""
    identity = _GROUP_IDENTITY if converted else (*_GROUP_IDENTITY, "is_expert_parallel")
    return [g for g in saved_groups if all(g.get(k) == group.get(k) for k in identity)]


def checkpoint_group_bounds(
    optimizer: Any, saved_common: Any, path: str
) -> list[tuple[Any, int, dict[str, Any]]]:
    """The checkpoint's schedule bounds (``max_lr``, ``min_lr``, ...) for each of this run's
    parameter groups, for ``scheduler.use_checkpoint_opt_param_scheduler`` after a
    conversion (the converted state carries this run's groups).

    Returns:
        ``(inner optimizer, group index, bounds)`` per group.

    Raises:
        CheckpointError: A group has no saved counterpart, or several with other bounds.
    """
    saved = saved_param_groups(saved_common)
    result = []
    for inner in optimizer_parts(optimizer):
        for index, group in enumerate(inner.param_groups):
            candidates = {
                tuple(_schedule_bounds(g).items())
                for g in _saved_counterparts(group, saved, converted=True)
            }
            if len(candidates) != 1:
                identity = {k: group.get(k) for k in _GROUP_IDENTITY}
                raise CheckpointError(
                    f"{path}: scheduler.use_checkpoint_opt_param_scheduler=True, but the "
                    f"checkpoint's parameter groups with {identity} hold {len(candidates)} "
                    "different learning-rate/weight-decay bounds for this run's converted "
                    "optimizer; set scheduler.override_opt_param_scheduler=True to use the "
                    "config's bounds"
                )
            result.append((inner, index, dict(candidates.pop())))
    return result


def _align_schedule_bounds(
    optimizer: MegatronOptimizer, saved_state: Any
) -> list[tuple[Any, int, dict]]:
    """Give the saved parameter groups the current groups' schedule bounds, for the load.

    megatron's non-distributed optimizers pair saved and current parameter groups by a key
    that includes ``max_lr``/``min_lr``/``start_wd``/``end_wd``; after
    ``scheduler.override_opt_param_scheduler`` or ``use_checkpoint_opt_param_scheduler``
    with another learning rate those differ, and the load would fail. Groups are paired by
    the rest of the key (weight-decay and learning-rate multipliers, expert and decoupled
    flags), when that pairing is one to one. Only megatron's non-distributed optimizers
    are aligned (the distributed one keeps its own groups); their saved groups are in the
    torch state dict (``FP32Optimizer``) or under ``"optimizer"`` (mixed precision).

    Returns:
        ``(inner optimizer, group index, the checkpoint's bounds)`` for each group whose
        bounds were replaced, so the caller can decide which bounds the run keeps (torch's
        load replaces the group dicts, hence indices).
    """
    inners = optimizer_parts(optimizer)
    parts = (
        [saved_state]
        if len(inners) == 1
        else list(saved_state.values() if isinstance(saved_state, dict) else saved_state)
    )
    replaced: list[tuple[Any, int, dict]] = []
    for inner, part in zip(inners, parts, strict=False):
        torch_state = part.get("optimizer", part) if isinstance(part, dict) else None
        saved_groups = torch_state.get("param_groups") if isinstance(torch_state, dict) else None
        current_groups = inner.param_groups
        if (
            type(inner).__name__ == "DistributedOptimizer"
            or not isinstance(saved_groups, list)
            or len(saved_groups) != len(current_groups)
        ):
            continue
        pairs = [_saved_counterparts(g, saved_groups, converted=False) for g in current_groups]
        if any(len(saved) != 1 for saved in pairs):
            continue  # not one to one: leave megatron's own pairing (and its error) alone
        for index, (current, [saved]) in enumerate(zip(current_groups, pairs, strict=True)):
            if all(saved.get(k) == current.get(k) for k in _SCHEDULE_BOUNDS):
                continue
            replaced.append((inner, index, _schedule_bounds(saved)))
            for key in _SCHEDULE_BOUNDS:
                saved.pop(key, None)
            saved.update(_schedule_bounds(current))
    return replaced


def load_optimizer(
    optimizer: MegatronOptimizer,
    loaded: Any,
    common: dict[str, Any],
    conversion: OptimizerConversion | None,
    scheduler: OptimizerParamScheduler | None,
    path: str,
) -> None:
    """Restore the optimizer state ``loaded`` (this run's template, or with ``conversion``
    the tensors to convert), converted first when ``conversion`` is set. The
    parameter groups' schedule bounds are the config's with ``override_opt_param_scheduler``,
    else the checkpoint's (as the scheduler's own settings); converted state carries this
    run's groups, so the checkpoint's bounds come from its saved common state."""
    keep = bool(getattr(scheduler, "override_opt_param_scheduler", False))
    bounds = [_schedule_bounds(group) for group in optimizer.param_groups]
    saved_common = common.get("optimizer")
    state = loaded
    if conversion is None:
        replaced = _align_schedule_bounds(optimizer, state)
    else:
        state = converted_optimizer_state(optimizer, conversion, loaded, saved_common, path)
        replaced = []
        if getattr(scheduler, "use_checkpoint_opt_param_scheduler", False) and not keep:
            # Without either flag the scheduler check made sure the bounds are equal.
            replaced = checkpoint_group_bounds(optimizer, saved_common, path)
    # megatron's distributed optimizer copies into its (grad-requiring) fp32 main shards, and
    # only some of its formats' loaders disable autograd themselves.
    with torch.no_grad(), _distributed_optimizer_steps(optimizer):
        optimizer.load_state_dict(state)
    if keep:
        for group, saved in zip(optimizer.param_groups, bounds, strict=True):
            group.update(saved)
    else:
        for inner, index, checkpoint_bounds in replaced:
            inner.param_groups[index].update(checkpoint_bounds)
    if conversion is None:
        return
    if conversion.main_params_from_model:
        # Saved from an fp32 model: its (now loaded) weights are the main parameters.
        optimizer.reload_model_params()
    if global_rank() == 0:
        saved_parts = common[META_KEY].get("optimizer_parts")
        logger.info(
            "%s holds %s optimizer state%s; converted to this run's %s optimizer (%d part(s))",
            path,
            common[META_KEY].get("optimizer_format"),
            f" ({saved_parts} part(s))" if saved_parts else "",
            optimizer_format(optimizer),
            len(optimizer_parts(optimizer)),
        )


@contextlib.contextmanager
def _distributed_optimizer_steps(optimizer: MegatronOptimizer) -> Iterator[None]:
    """Keep torch Adam's per-parameter ``step`` right through a megatron distributed
    optimizer's load (without Apex / Transformer Engine, as on CPU; megatron-core 0.19).

    Its ``fully_reshardable`` loader puts a ``step`` into every parameter's state (from the
    saved parameter groups), then ``_set_main_param_and_optimizer_states`` copies every
    state tensor from the checkpoint, which holds no per-parameter ``step``: ``KeyError:
    'step'``. For the duration of the load the step already in place is handed in as its
    own source; so is a main parameter the checkpoint does not hold (per-parameter state of
    an fp32 model, converted by :mod:`~bridge.train.checkpointing.optimizer_conversion`): it
    stays as it is and is refreshed from the loaded model weights.

    After the load, every parameter gets its own tensor holding the loaded count (the saved
    parameter groups' ``step``): ``load_state_dict`` leaves the per-parameter ``step`` of an
    already allocated optimizer at its old value and, when it does set it, stores one shared
    tensor in every parameter's state, which torch's Adam then increments once per
    parameter. Either way the bias correction after a resume would be wrong.
    """
    parts = distributed_parts(optimizer)
    for inner in parts:

        def keep_step(
            model_param: Any,
            tensors: dict[str, Any],
            _inner: Any = inner,
            _original: Any = inner._set_main_param_and_optimizer_states,
        ) -> Any:
            group_index, group_order = _inner.model_param_group_index_map[model_param]
            main = _inner.optimizer.param_groups[group_index]["params"][group_order]
            if "param" not in tensors:  # not in the checkpoint: keep it (optimizer_conversion)
                tensors = {**tensors, "param": main}
            step = _inner.optimizer.state.get(main, {}).get("step")
            if "step" not in tensors and isinstance(step, torch.Tensor):
                tensors = {**tensors, "step": step}
            return _original(model_param, tensors)

        inner._set_main_param_and_optimizer_states = keep_step
    try:
        yield
    finally:
        for inner in parts:
            del inner._set_main_param_and_optimizer_states
    for inner in parts:
        torch_optimizer = inner.optimizer
        for group in torch_optimizer.param_groups:
            if group.get("step") is None:
                continue
            for param in group["params"]:
                param_state = torch_optimizer.state[param]
                if param_state:  # torch's Adam: a step of its own next to exp_avg(_sq)
                    param_state["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)
