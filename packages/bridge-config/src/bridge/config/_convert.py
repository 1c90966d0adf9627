"""Building one config dataclass from another with the same field names."""

from __future__ import annotations

import dataclasses
from typing import Any

from bridge.config._errors import ConfigError


def convert_dataclass[T](source: Any, target_cls: type[T], /, **overrides: Any) -> T:
    """Build ``target_cls`` from the same-named attributes of ``source``.

    This is how the trainer turns bridge.config sections into megatron-core's classes
    without bridge.config importing megatron-core, e.g.
    ``convert_dataclass(cfg.dataset, megatron.core.datasets.gpt_dataset.GPTDatasetConfig,
    tokenizer=tokenizer)`` or ``convert_dataclass(cfg.ddp, DistributedDataParallelConfig)``.
    Every init field of ``target_cls`` is taken from ``overrides`` if given there, else
    from ``source`` if it has that attribute, else left at the target's default. Fields of
    ``source`` that ``target_cls`` does not have are ignored.

    Args:
        source: Any object (usually a config dataclass).
        target_cls: The dataclass to build.
        **overrides: Values for fields of ``target_cls`` that ``source`` lacks or that should
            differ (such as a runtime tokenizer object).

    Returns:
        The new ``target_cls`` instance.

    Raises:
        ConfigError: ``target_cls`` is not a dataclass, an override names no init field of
            it, a required field has no value, or ``target_cls`` rejects the values.
    """
    if not (isinstance(target_cls, type) and dataclasses.is_dataclass(target_cls)):
        raise ConfigError("target_cls", f"got {target_cls!r}; expected a dataclass type")
    init_fields = [f for f in dataclasses.fields(target_cls) if f.init]
    names = {f.name for f in init_fields}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ConfigError(
            target_cls.__qualname__,
            f"{', '.join(unknown)} is not an init field; valid fields: {', '.join(sorted(names))}",
        )
    kwargs: dict[str, Any] = {}
    for f in init_fields:
        if f.name in overrides:
            kwargs[f.name] = overrides[f.name]
        elif hasattr(source, f.name):
            kwargs[f.name] = getattr(source, f.name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(
                f"{target_cls.__qualname__}.{f.name}",
                f"required, but {type(source).__qualname__} has no {f.name!r}; pass {f.name}=...",
            )
    try:
        return target_cls(**kwargs)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(target_cls.__qualname__, f"rejected the converted values: {exc}") from exc
