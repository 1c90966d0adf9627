"""What a config changes relative to the declared defaults, and its plain data by dotted
path, for printing by a CLI and logging as a run's parameters."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import yaml

from bridge.config._codec import TARGET, encode, fields_left_out, join

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

#: Shown as the default of a field that has none (it must always be given).
REQUIRED = "<required>"


@dataclasses.dataclass(frozen=True)
class ConfigDiff:
    """One value that differs from its default.

    Attributes:
        path: Dotted path of the field, e.g. ``train.train_iters`` or ``dataset._target_``.
        default: The declared default in plain-data form (``"<required>"`` if there is none).
        value: The current value in plain-data form.
    """

    path: str
    default: Any
    value: Any


def _declared_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return REQUIRED


def _target(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _diff_object(obj: Any, path: str, out: list[ConfigDiff]) -> None:
    left_out = fields_left_out(obj)
    for f in dataclasses.fields(obj):
        if f.name.startswith("_") or f.name in left_out:
            continue
        value = getattr(obj, f.name)
        default = _declared_default(f)
        where = join(path, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            same_class = type(default) is type(value)
            if not same_class:
                default_target = (
                    encode(default, strict=False).get(TARGET)
                    if dataclasses.is_dataclass(default)
                    else default
                )
                value_target = encode(value, strict=False).get(TARGET, _target(value))
                out.append(ConfigDiff(join(where, TARGET), default_target, value_target))
            _diff_object(value, where, out)
            continue
        current = encode(value, where, strict=False)
        expected = default if default is REQUIRED else encode(default, where, strict=False)
        if current != expected:
            out.append(ConfigDiff(where, expected, current))


def diff_from_defaults(config: DataclassInstance) -> list[ConfigDiff]:
    """List every value of a config dataclass that differs from its declared default.

    Args:
        config: A ``ConfigContainer`` or any config dataclass.

    Returns:
        The differences in field order, nested sections included.
    """
    out: list[ConfigDiff] = []
    _diff_object(config, "", out)
    return out


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings flattened to dotted keys (``{"train": {"lr": 1}}`` -> ``train.lr``).

    Only mappings are descended into: lists, ``None`` and other values are kept as they
    are, and an empty mapping contributes no key.

    Args:
        config: Plain config data, e.g. ``yaml.safe_load(cfg.to_yaml_text())``.
        prefix: Dotted path of ``config`` itself (``""`` for the root).

    Returns:
        Dotted path -> value, in the mappings' order.
    """
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = join(prefix, str(key))
        if isinstance(value, Mapping):
            flat.update(flatten_config(value, name))
        else:
            flat[name] = value
    return flat


def _inline(value: Any) -> str:
    if isinstance(value, str):
        return value if value == REQUIRED else repr(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    text = text.removesuffix("\n...").strip()
    return text if len(text) <= 120 else text[:117] + "..."


def format_diff(diffs: Sequence[ConfigDiff]) -> str:
    """Render differences as ``path: default -> value`` lines (empty string if none)."""
    return "".join(f"{d.path}: {_inline(d.default)} -> {_inline(d.value)}\n" for d in diffs)
