"""Range checks for the sections whose classes come from megatron-core.

bridge.config's own sections check their values in ``__post_init__``. The ``optimizer``
(megatron-core's ``OptimizerConfig``) and ``model`` (a ``TransformerConfig`` subclass)
sections do not: megatron accepts ``lr=inf``, a negative learning rate, ``adam_beta1=1.5``
or ``hidden_dropout=2`` and fails (or trains on NaN) much later, if at all. The bounds
below are the ones these values have in megatron's (and torch's) meaning.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from bridge.config._errors import ConfigError, suggest
from bridge.config._protocols import OptimizerConfigProtocol
from bridge.config._training import SchedulerConfig

# field: (low, high, low end open, high end open); a bound of None: unbounded.
_OPTIMIZER_RANGES: dict[str, tuple[float | None, float | None, bool, bool]] = {
    "lr": (0.0, None, False, False),
    "min_lr": (0.0, None, False, False),
    "decoupled_lr": (0.0, None, False, False),
    "decoupled_min_lr": (0.0, None, False, False),
    "weight_decay": (0.0, None, False, False),
    "adam_beta1": (0.0, 1.0, False, True),
    "adam_beta2": (0.0, 1.0, False, True),
    "adam_eps": (0.0, None, True, False),
    "sgd_momentum": (0.0, 1.0, False, False),
    "clip_grad": (0.0, None, False, False),
    "loss_scale": (0.0, None, True, False),
    "initial_loss_scale": (0.0, None, True, False),
    "min_loss_scale": (0.0, None, True, False),
    "hysteresis": (1.0, None, False, False),
    "loss_scale_window": (1.0, None, False, False),
}

_MODEL_RANGES: dict[str, tuple[float | None, float | None, bool, bool]] = {
    "hidden_dropout": (0.0, 1.0, False, False),
    "attention_dropout": (0.0, 1.0, False, False),
    "init_method_std": (0.0, None, True, False),
    "layernorm_epsilon": (0.0, None, True, False),
}

# Optimizer names megatron-core's get_megatron_optimizer builds.
_OPTIMIZERS = ("adam", "sgd", "lion", "muon")


def _interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if high is None:
        return f"a number {'>' if low_open else '>='} {low:g}"
    left = "(" if low_open else "["
    right = ")" if high_open else "]"
    return f"a number in {left}{low:g}, {high:g}{right}"


def _check(section: Any, prefix: str, ranges: dict[str, Any]) -> None:
    for f in dataclasses.fields(section):
        value = getattr(section, f.name, None)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        bounds = ranges.get(f.name)
        default = f.default
        infinite_default = isinstance(default, float) and math.isinf(default)
        if (
            isinstance(value, float)
            and not math.isfinite(value)
            and not (
                infinite_default and value == default  # inf is this field's "off" (its default)
            )
        ):
            expected = _interval(*bounds) if bounds else "a finite number"
            raise ConfigError(
                f"{prefix}.{f.name}",
                f"got {value!r}; expected {expected} (NaN and infinity are not valid here)",
            )
        if bounds is None:
            continue
        low, high, low_open, high_open = bounds
        too_low = low is not None and (value <= low if low_open else value < low)
        too_high = high is not None and (value >= high if high_open else value > high)
        if too_low or too_high:
            raise ConfigError(
                f"{prefix}.{f.name}",
                f"got {value!r}; expected {_interval(low, high, low_open, high_open)}",
            )


def check_value_ranges(optimizer: Any, model: Any) -> None:
    """Refuse non-finite or out-of-range values in the optimizer and model sections.

    Args:
        optimizer: The ``optimizer`` section (megatron-core ``OptimizerConfig`` or any
            dataclass with its field names), or None.
        model: The ``model`` section, or None.

    Raises:
        ConfigError: naming the field, the value and the valid range.
    """
    if optimizer is not None and dataclasses.is_dataclass(optimizer):
        _check(optimizer, "optimizer", _OPTIMIZER_RANGES)
        name = getattr(optimizer, "optimizer", None)
        if isinstance(name, str) and name not in _OPTIMIZERS:
            raise ConfigError(
                "optimizer.optimizer",
                f"got {name!r}; megatron-core builds "
                f"{', '.join(repr(a) for a in _OPTIMIZERS)}.{suggest(name, _OPTIMIZERS)}",
            )
    if model is not None and dataclasses.is_dataclass(model):
        _check(model, "model", _MODEL_RANGES)


def check_learning_rates(
    optimizer: OptimizerConfigProtocol, scheduler: SchedulerConfig | None
) -> None:
    """Refuse learning rates megatron-core's ``OptimizerParamScheduler`` cannot schedule.

    ``ConfigContainer.validate()`` applies it; bridge-train's ``mimo`` recipe, whose sections
    are not validated, checks them with it in its launch checks.

    Args:
        optimizer: The ``optimizer`` section (its ``lr`` and ``min_lr``).
        scheduler: The ``scheduler`` section (its ``lr_warmup_init``), or None.

    Raises:
        ConfigError: ``optimizer.lr`` is unset, ``optimizer.min_lr`` is above it, or
            ``scheduler.lr_warmup_init`` is above it.
    """
    lr, min_lr = getattr(optimizer, "lr", None), getattr(optimizer, "min_lr", None)
    if lr is None:
        raise ConfigError("optimizer.lr", "is required; set the peak learning rate, e.g. 3e-4")
    if isinstance(min_lr, (int, float)) and min_lr > lr:
        raise ConfigError(
            "optimizer.min_lr",
            f"got {min_lr!r}, above optimizer.lr={lr!r}; the learning rate decays from lr "
            "down to min_lr, so set min_lr <= lr",
        )
    init = getattr(scheduler, "lr_warmup_init", None)
    if isinstance(init, (int, float)) and init > lr:
        raise ConfigError(
            "scheduler.lr_warmup_init",
            f"got {init!r}, above optimizer.lr={lr!r}; the warm-up rises from lr_warmup_init "
            "to lr, so set lr_warmup_init <= lr",
        )
