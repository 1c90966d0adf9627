"""Dotted command-line overrides (``train.train_iters=100``) applied through OmegaConf."""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import typing
from collections.abc import Iterable, Sequence
from typing import Any

import yaml

from bridge.config._codec import (
    DEFAULT_CLASS,
    REFUSE_DERIVED_VALUES,
    TARGET,
    decode,
    encode,
    import_object,
    join,
)
from bridge.config._container import ConfigContainer
from bridge.config._errors import ConfigError, suggest
from bridge.config._typing import field_types, is_union
from bridge.config._yaml import (
    naming_interpolation_sources,
    read_yaml_mapping,
    resolve_interpolations,
)

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def parse_overrides(overrides: Iterable[str]) -> list[tuple[str, Any]]:
    """Parse ``section.field=value`` strings into ``(dotted key, value)`` pairs.

    Values are parsed by OmegaConf's grammar: ``100`` is an int, ``3e-4`` a float,
    ``true``/``false`` booleans, ``null`` (or nothing) ``None``, ``[1,2]`` a list,
    ``{a: 1}`` a mapping, ``'100'`` (quoted) a string, and ``${model.seq_length}`` an
    interpolation resolved against the whole config.

    Args:
        overrides: The strings, typically the command-line arguments after the config path.

    Returns:
        The pairs in the given order.

    Raises:
        ConfigError: an item has no ``=``, its key is not a dotted identifier path, its
            value does not parse, or a key is given twice (also as part of a section given
            whole, ``train={...}`` with ``train.train_iters=5``): which one was meant is
            not clear, so neither is used.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    parsed: list[tuple[str, Any]] = []
    for item in overrides:
        if not isinstance(item, str):
            raise ConfigError(repr(item), "an override must be a string 'section.field=value'")
        if "=" not in item:
            raise ConfigError(
                item,
                "override has no '='; write section.field=value (e.g. train.train_iters=100); "
                "a recipe file goes first (bridge-train recipe.yaml ...) or after --config",
            )
        key, raw = item.split("=", 1)
        key = key.strip()
        if not _KEY.match(key):
            raise ConfigError(
                item,
                f"{key!r} is not a dotted field path; write section.field=value (e.g. optimizer.lr=3e-4)",
            )
        try:
            node = OmegaConf.to_container(OmegaConf.from_dotlist([f"{key}={raw}"]), resolve=False)
        except (OmegaConfBaseException, yaml.YAMLError) as exc:
            message = " ".join(str(exc).split()) or type(exc).__name__
            raise ConfigError(item, f"cannot parse the value {raw!r}: {message}") from None
        value: Any = node
        for part in key.split("."):
            assert isinstance(value, dict)
            value = value[part]
        _refuse_repeat(parsed, key, item)
        parsed.append((key, value))
    return parsed


def _refuse_repeat(parsed: list[tuple[str, Any]], key: str, item: str) -> None:
    for earlier, _ in parsed:
        if earlier == key or key.startswith(earlier + ".") or earlier.startswith(key + "."):
            same = "is given twice" if earlier == key else f"overlaps the override of {earlier}"
            raise ConfigError(key, f"{same} in the overrides ({item!r}); give each field once")


def _merge(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


# Fields of which a config sets at most one: an override of one replaces the recipe's choice
# (the built-in recipes warm up by lr_warmup_fraction; scheduler.lr_warmup_iters=5 on the
# command line means "warm up 5 iterations instead", not a conflict).
_ALTERNATIVES = (
    ("scheduler.lr_warmup_fraction", "scheduler.lr_warmup_iters", "scheduler.lr_warmup_samples"),
)


def _drop_replaced_alternatives(data: dict[str, Any], override_keys: list[str]) -> None:
    for group in _ALTERNATIVES:
        chosen = [key for key in override_keys if key in group]
        if not chosen:
            continue
        for other in group:
            if other in chosen:
                continue
            section, _, name = other.rpartition(".")
            node = data.get(section)
            if isinstance(node, dict):
                node.pop(name, None)


def _drop_fields_of_replaced_classes(data: dict[str, Any], pairs: list[tuple[str, Any]]) -> None:
    """Drop the file's fields of a section whose class an override replaces, where the new
    class has no such field.

    ``dataset._target_=bridge.config.FinetuningDatasetConfig`` on a recipe with a GPT
    dataset means "this kind of data instead": the old class's ``blend`` or ``split`` mean
    nothing to the new one. Fields both classes have keep the file's values; the fields the
    overrides themselves give are never dropped (an unknown one is refused as usual).
    """
    given = {key for key, _ in pairs}
    for key, value in pairs:
        section, _, name = key.rpartition(".")
        if name != TARGET or not isinstance(value, str):
            continue
        node: Any = data
        for part in section.split(".") if section else ():
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or node.get(TARGET) == value:
            continue
        try:
            cls = import_object(value, key)
        except ConfigError:
            continue  # reported, with the field, when the section is built
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            continue
        accepted = {f.name for f in dataclasses.fields(cls) if f.init}
        for field_name in list(node):
            if field_name in (TARGET, *accepted) or join(section, field_name) in given:
                continue
            del node[field_name]


def load_config(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> ConfigContainer:
    """Read a YAML recipe, apply dotted overrides, resolve interpolations and build the config.

    An override of one of a set of alternative fields (``scheduler.lr_warmup_iters``,
    ``lr_warmup_fraction``, ``lr_warmup_samples``) replaces the one the YAML chose.

    Overrides are merged into the YAML data before anything is built, so they can add or
    replace whole sections (``ft.enable_ft_package=true`` creates the ``ft`` section,
    ``dataset._target_=bridge.config.MockGPTDatasetConfig`` switches the dataset class) and
    every check runs on the final values only. A ``_target_`` override that switches a
    section's class drops the file's fields of that section the new class does not have
    (the old class's ``blend`` means nothing to an SFT dataset); the fields both have keep
    the file's values.

    Args:
        path: The YAML file.
        overrides: ``section.field=value`` strings (see ``parse_overrides``).

    Returns:
        The built container (not yet validated: call ``validate()``).

    Raises:
        ConfigError: for any problem with the file, an override or a value, including a
            value for a field `validate()` computes (`scheduler.lr_decay_steps`).
    """
    data = read_yaml_mapping(path)
    pairs = parse_overrides(overrides)
    _drop_replaced_alternatives(data, [key for key, _ in pairs])
    _drop_fields_of_replaced_classes(data, pairs)
    for key, value in pairs:
        _merge(data, key, value)
    token = REFUSE_DERIVED_VALUES.set(True)
    try:
        with naming_interpolation_sources(data):
            return ConfigContainer.from_dict(resolve_interpolations(data, str(path)))
    finally:
        REFUSE_DERIVED_VALUES.reset(token)


def apply_overrides[C: ConfigContainer](container: C, overrides: Sequence[str]) -> C:
    """Apply dotted overrides to a built container, checking each value against its field.

    The input is left unchanged; a modified deep copy is returned. Values a previous
    ``validate()`` filled in (``train.global_batch_size`` left unset, ``lr_decay_iters``,
    the scheduler steps, ...) are unset in the copy, as in a config saved and loaded
    again, so the next ``validate()`` derives them from the overridden values. A section
    that is unset (``None``) is created with its defaults before a field of it is set.
    Every changed bridge.config section re-runs its checks on the final values. Objects
    from other packages (a megatron-core model config) get the new field values as they
    are, without re-running their own ``__post_init__``: values they derive from others
    (e.g. ``ffn_hidden_size`` from ``hidden_size``) are not recomputed, so set those
    explicitly or override in the YAML with ``load_config``.

    Args:
        container: The config to start from.
        overrides: ``section.field=value`` strings (see ``parse_overrides``).

    Returns:
        A new container with the overrides applied.

    Raises:
        ConfigError: unknown section or field (with a suggestion), a value of the wrong
            type, a derived field, a ``_target_`` change, or a failing section check.
    """
    pairs = parse_overrides(overrides)
    if any(_has_interpolation(value) for _, value in pairs):
        snapshot = encode(container, strict=False)
        for key, value in pairs:
            _merge(snapshot, key, value)
        resolved = resolve_interpolations(snapshot, "overrides")
        pairs = [(key, _lookup(resolved, key)) for key, _ in pairs]
    result = copy.deepcopy(container)
    result._clear_derived_values()
    touched: dict[str, Any] = {}
    for key, value in pairs:
        _set_path(result, key, value, touched)
    for path in sorted(touched, key=lambda p: -p.count(".")):
        obj = touched[path]
        if type(obj).__module__.startswith("bridge.config") and hasattr(obj, "__post_init__"):
            try:
                obj.__post_init__()
            except ConfigError as exc:
                raise exc.within(path, type(obj).__name__) from exc.__cause__
    return result


def _has_interpolation(value: Any) -> bool:
    if isinstance(value, str):
        return "${" in value
    if isinstance(value, dict):
        return any(_has_interpolation(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_interpolation(v) for v in value)
    return False


def _lookup(data: dict[str, Any], key: str) -> Any:
    node: Any = data
    for part in key.split("."):
        node = node[part]
    return node


def _field(obj: Any, name: str, path: str) -> dataclasses.Field[Any]:
    fields = {f.name: f for f in dataclasses.fields(obj)}
    if name == TARGET:
        raise ConfigError(
            path,
            "apply_overrides cannot change a section's class; pass the override to load_config "
            "(which rebuilds from the YAML) or edit the YAML",
        )
    if name not in fields or name.startswith("_"):
        noun = getattr(type(obj), "__config_key_noun__", "field")
        visible = [n for n in fields if not n.startswith("_")]
        raise ConfigError(
            path, f"unknown {noun} of {type(obj).__qualname__}.{suggest(name, visible)}"
        )
    return fields[name]


def _default_section(obj: Any, f: dataclasses.Field[Any], path: str) -> Any:
    """Build the section a ``None`` field would hold, from its class defaults."""
    declared = field_types(type(obj)).get(f.name)
    options = [a for a in getattr(declared, "__args__", ())] if is_union(declared) else [declared]
    classes = [a for a in options if isinstance(a, type) and dataclasses.is_dataclass(a)]
    cls = f.metadata.get(DEFAULT_CLASS) or (classes[0] if classes else None)
    if cls is None and any(typing.get_origin(a) is dict or a is dict for a in options):
        return {}
    if cls is None:
        raise ConfigError(
            path,
            "section is not set and has no default class; set it in the YAML with a _target_ "
            "(or pass the override to load_config)",
        )
    return decode({}, cls, path)


def _set_path(container: Any, key: str, value: Any, touched: dict[str, Any]) -> None:
    parts = key.split(".")
    obj: Any = container
    path = ""
    touched[path] = container
    for part in parts[:-1]:
        where = join(path, part)
        if isinstance(obj, dict):
            child = obj.get(part)
            if not isinstance(child, dict):
                child = {}
                obj[part] = child
        elif dataclasses.is_dataclass(obj):
            f = _field(obj, part, where)
            child = getattr(obj, part)
            if child is None:
                child = _default_section(obj, f, where)
                object.__setattr__(obj, part, child)
            if not (dataclasses.is_dataclass(child) or isinstance(child, dict)):
                raise ConfigError(where, f"holds {child!r}, not a section; cannot set {key}")
        else:
            raise ConfigError(path, f"holds {obj!r}, not a section; cannot set {key}")
        if dataclasses.is_dataclass(child):
            touched[where] = child
        obj, path = child, where
    name = parts[-1]
    where = join(path, name)
    if isinstance(obj, dict):
        obj[name] = decode(value, Any, where)
        return
    f = _field(obj, name, where)
    if not f.init:
        raise ConfigError(
            where, "is computed (by validate() or the section itself) and cannot be set"
        )
    declared = field_types(type(obj)).get(name, Any)
    object.__setattr__(
        obj, name, decode(value, declared, where, default_class=f.metadata.get(DEFAULT_CLASS))
    )
