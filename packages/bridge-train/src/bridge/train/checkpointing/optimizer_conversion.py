"""Optimizer state saved by another kind of megatron optimizer, loaded into this run's.

Every per-parameter optimizer tensor is saved under its parameter's layout-free sharded key
by megatron-core's non-distributed optimizers (``optimizer.state.exp_avg.<key>``, fp32 main
parameters of a bf16/fp16 model as ``optimizer.state.fp32_param.<key>``) and by its
distributed optimizer in the ``fully_reshardable`` format (the same moment keys, the fp32
main parameter as ``optimizer.state.param.<key>``). So the tensors of one kind load into
the template of the other; what differs is the layout around them: how many optimizer parts
there are (megatron optimises expert-parallel parameters apart when expert parallelism is
on), how they are numbered and grouped, and where the Adam step and the loss scale live.

:func:`conversion_template` builds this run's own optimizer template with the main-parameter
keys pointed at the checkpoint's spelling, :func:`converted_optimizer_state` then lays the
loaded tensors out as this run's optimizer loads them, with this run's parameter groups
(hyperparameters are the config's, the learning rate and weight decay the restored
scheduler's) and the saved step and loss scale. Main parameters the checkpoint does not hold
(it was saved from an fp32 model, whose weights are the main parameters) are refreshed from
the loaded model weights, which is exact for them.

Used when the saved optimizer format (distributed or per-parameter) or the number of
optimizer parts differs from this run's: the distributed optimizer or expert parallelism
switched on or off, also with bf16. Checkpoints of bridge-train's retired portable engine
(``optimizer_format: portable``) hold per-parameter state under megatron's own keys (the
step as ``common_step``, the loss scale as ``grad_scaler``) and convert the same way. The
older ``dp_reshardable`` distributed format is kept per data-parallel bucket and cannot be
converted (refused in ``load._check_reshardable``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedTensor,
    ShardedTensorFactory,
)

from bridge.train.checkpointing.errors import CheckpointError
from bridge.train.checkpointing.state_dict import optimizer_parts

__all__ = [
    "OptimizerConversion",
    "conversion_template",
    "converted_optimizer_state",
    "saved_param_groups",
]

# The spellings of an fp32 main parameter's key: megatron's non-distributed mixed-precision
# optimizer, and its distributed optimizer.
_MAIN_PARAM_PREFIXES = ("optimizer.state.fp32_param.", "optimizer.state.param.")

# Stands for a main parameter the checkpoint does not hold until it is dropped or replaced.
_FROM_MODEL = object()


@dataclass
class OptimizerConversion:
    """This run's optimizer template, to be loaded from a checkpoint of another format.

    Attributes:
        template: ``optimizer.sharded_state_dict(..., is_loading=True)`` with the main
            parameters' keys renamed to the checkpoint's spelling.
        to_load: The sharded tensors (and factories) of ``template`` that the checkpoint
            holds, numbered in template order; load them as a template entry of their own.
        main_params_from_model: Parts whose fp32 main parameters the checkpoint does not
            hold; they are refreshed from the loaded model weights.
    """

    template: Any
    to_load: dict[int, Any] = field(default_factory=dict)
    main_params_from_model: bool = False


def _main_param_alternative(key: str, saved_keys: Any) -> str | None:
    """The checkpoint's key of the main parameter ``key`` names, or None if it has none."""
    for prefix in _MAIN_PARAM_PREFIXES:
        if key.startswith(prefix):
            names = (other + key.removeprefix(prefix) for other in _MAIN_PARAM_PREFIXES)
            return next((name for name in names if name in saved_keys), None)
    return key  # not a main parameter: loaded under its own key


def conversion_template(optimizer_template: Any, saved_keys: Any) -> OptimizerConversion:
    """Point ``optimizer_template``'s main-parameter keys at the checkpoint's spelling.

    Args:
        optimizer_template: This run's optimizer sharded state dict for loading.
        saved_keys: The checkpoint's tensor keys (``load_tensors_metadata``).

    Returns:
        The conversion plan; the template is changed in place.
    """
    conversion = OptimizerConversion(optimizer_template)
    index = 0

    def plan(value: Any) -> Any:
        nonlocal index
        if not isinstance(value, (ShardedTensor, ShardedTensorFactory)):
            return value
        key = _main_param_alternative(value.key, saved_keys)
        if key is None:
            # An fp32 model's checkpoint: its weights are the main parameters.
            conversion.main_params_from_model = True
            return value
        if key != value.key:
            value = replace(value, key=key)
        conversion.to_load[index] = value
        index += 1
        return value

    dict_list_map_inplace(plan, optimizer_template)
    return conversion


def _values_under(tree: Any, name: str) -> Iterator[Any]:
    """Every value stored under the key ``name`` in nested dicts, lists and tuples."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from [value] if key == name else _values_under(value, name)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _values_under(value, name)


def saved_param_groups(tree: Any) -> list[dict[str, Any]]:
    """Every parameter group a saved optimizer's common state holds (all parts)."""
    return [
        group
        for groups in _values_under(tree, "param_groups")
        if isinstance(groups, list)
        for group in groups
        if isinstance(group, dict)
    ]


def converted_optimizer_state(
    optimizer: Any,
    conversion: OptimizerConversion,
    loaded: dict[int, Any],
    saved_common: Any,
    path: str,
) -> Any:
    """The state ``optimizer.load_state_dict`` takes, from another format's checkpoint.

    Args:
        optimizer: This run's megatron optimizer (chained or not).
        conversion: From :func:`conversion_template`.
        loaded: The loaded tensors of ``conversion.to_load`` (same numbering).
        saved_common: The checkpoint's common (non-tensor) ``optimizer`` entry.
        path: The checkpoint directory (for messages).

    Returns:
        The state dict for ``optimizer.load_state_dict``.

    Raises:
        CheckpointError: The checkpoint records no step, or differing steps.
    """
    # Every Adam step it records: common_step of the per-parameter optimizers, step of the
    # distributed optimizer's parameter groups.
    steps = {float(v) for v in _values_under(saved_common, "common_step") if v is not None} | {
        float(g["step"]) for g in saved_param_groups(saved_common) if g.get("step") is not None
    }
    if len(steps) != 1:
        raise CheckpointError(
            f"{path}: its optimizer state records "
            + ("no Adam step" if not steps else f"differing steps {sorted(steps)}")
            + ", so it cannot be converted to this run's optimizer; set "
            "checkpoint.load_optim=False to load the model (and train state) alone"
        )
    step = steps.pop()
    # The loss scaler's saved state (fp16), or None.
    scaler = next(
        (v for v in _values_under(saved_common, "grad_scaler") if isinstance(v, dict)), None
    )
    # Walk the template in the order conversion_template numbered it, matching the tensors
    # loaded by identity; the others are main parameters refreshed from the model later.
    order = iter(sorted(conversion.to_load))
    expected = next(order, None)

    def fill(value: Any) -> Any:
        nonlocal expected
        if isinstance(value, LocalNonpersistentObject):  # megatron's parameter indices
            return value.unwrap()
        if not isinstance(value, (ShardedTensor, ShardedTensorFactory)):
            return value
        if expected is not None and conversion.to_load[expected] is value:
            tensor = loaded[expected]
            expected = next(order, None)
            return tensor
        return _FROM_MODEL

    state = conversion.template
    dict_list_map_inplace(fill, state)
    inners = optimizer_parts(optimizer)
    parts = [state[i] for i in range(len(inners))] if len(inners) > 1 else [state]
    for inner, part in zip(inners, parts, strict=True):
        if type(inner).__name__ == "DistributedOptimizer":
            for group in part["optimizer"]["param_groups"]:
                group["step"] = step
            # Left out, megatron's loader keeps the main parameter as it is (a view of an
            # fp32 model's loaded weight, else refreshed from the model afterwards).
            for tensors in part["param_state"].values():
                if tensors.get("param") is _FROM_MODEL:
                    del tensors["param"]
        elif hasattr(inner, "fp32_from_float16_groups"):
            part["optimizer"]["state"]["common_step"] = torch.tensor(step)
            # Copied onto themselves, then refreshed from the model afterwards.
            part["fp32_from_fp16_params"] = [
                [
                    own if value is _FROM_MODEL else value
                    for value, own in zip(saved, mine, strict=True)
                ]
                for saved, mine in zip(
                    part["fp32_from_fp16_params"], inner.fp32_from_float16_groups, strict=True
                )
            ]
        else:
            part["state"]["common_step"] = torch.tensor(step)
        if scaler is not None and getattr(inner, "grad_scaler", None) is not None:
            part["grad_scaler"] = scaler
    return state if len(inners) > 1 else parts[0]
