"""Conversion between config objects and plain data (dicts, lists, scalars), with type checks.

Plain data is what YAML and OmegaConf hold. Objects that are not plain travel in a tagged
form, the same one Hydra users know:

* a dataclass (a bridge-config section, a megatron-core config, a model provider):
  ``{_target_: package.module.Class, <field>: <value>, ...}``;
* a function or class used as a value: ``{_target_: package.module.function, _call_: false}``;
* a ``functools.partial``: ``{_target_: package.module.function, _partial_: true, <kwarg>: ...}``
  (positional arguments, if any, under ``_args_``);
* a ``torch.dtype``: ``{_dtype_: torch.bfloat16}``;
* an enum member: ``{_enum_: package.module.EnumClass.MEMBER}``.

Decoding is driven by the declared type of the field being filled, so every value is
checked (and losslessly converted, e.g. ``1`` to ``1.0`` for a float or a list to a tuple)
against the dataclass annotation, and every problem is a :class:`ConfigError` naming the
dotted path of the field.
"""

from __future__ import annotations

import collections.abc
import contextvars
import dataclasses
import enum
import functools
import importlib
import logging
import math
import pathlib
import sys
import typing
from typing import Any, Literal

from bridge.config._errors import ConfigError, suggest
from bridge.config._section import filled_fields, unknown_key_detail
from bridge.config._typing import (
    field_types,
    is_protocol,
    is_torch_dtype,
    is_torch_dtype_type,
    is_union,
    missing_protocol_members,
    protocol_members,
    type_name,
)

TARGET = "_target_"
CALL = "_call_"
PARTIAL = "_partial_"
ARGS = "_args_"
DTYPE = "_dtype_"
ENUM = "_enum_"
RESERVED_KEYS = frozenset({TARGET, DTYPE, ENUM})

#: dataclass field metadata key: the class to build when a dict without ``_target_`` fills a
#: field whose declared type is a Protocol (for example ``ConfigContainer.ddp``).
DEFAULT_CLASS = "bridge_config_default_class"

_OWN_PACKAGE = "bridge.config"

#: Fields megatron-core's training code fills with live objects at run time (the schedule's
#: gradient-sync hooks, the loss-scale function, the timers). They are not configuration:
#: encoding leaves them out, so saved configs load back with their defaults (``None``).
RUNTIME_FIELDS = frozenset(
    {
        "no_sync_func",
        "grad_sync_func",
        "param_sync_func",
        "finalize_model_grads_func",
        "grad_scale_func",
        "timers",
    }
)


def fields_left_out(obj: Any, *, omit_derived: bool = True) -> frozenset[str]:
    """Names of the dataclass fields of ``obj`` that encoding leaves out.

    * :data:`RUNTIME_FIELDS` and any names in ``obj.runtime_fields`` (live objects set at
      run time);
    * with ``omit_derived``, the names in ``obj.derived_fields``: values the object computed
      from its other fields in ``__post_init__`` and still holds. Left out, they are derived
      again when the saved config is loaded, so a loaded config whose ``hidden_size`` is then
      overridden also gets a matching ``ffn_hidden_size``;
    * with ``omit_derived``, the fields ``ConfigContainer.validate()`` filled in and that
      still hold that value (``train.global_batch_size`` the user left unset, the scheduler
      steps, ...): derived again by the next ``validate()``. Encoding writes them as
      ``None`` (unset) rather than leaving them out.
    """
    names = set(RUNTIME_FIELDS)
    names.update(getattr(obj, "runtime_fields", None) or ())
    if omit_derived:
        names.update(getattr(obj, "derived_fields", None) or ())
        names.update(filled_fields(obj))
    return frozenset(names)


def _encoded_fields(value: Any, omit_derived: bool) -> list[tuple[str, bool]]:
    """``(field name, encode its value?)`` for each field of a dataclass that is written.

    A field ``validate()`` filled in is written as ``None`` (encode: False), the unset value
    the user left, so a reloaded and re-validated config saves the same file again.
    """
    left_out = fields_left_out(value, omit_derived=omit_derived)
    filled = filled_fields(value) if omit_derived else {}
    written = []
    for f in dataclasses.fields(value):
        if f.name.startswith("_"):
            continue
        if f.name in filled:
            written.append((f.name, False))
        elif f.name not in left_out:
            written.append((f.name, True))
    return written


def join(path: str, key: str) -> str:
    """Join a dotted config path and a field name."""
    return f"{path}.{key}" if path else key


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ----------------------------------------------------------------------------- import paths


def _resolve_attr(obj: Any, qualname: str) -> Any:
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def import_path(obj: Any, path: str = "") -> str:
    """Return the shortest importable dotted path that yields exactly ``obj``.

    ``bridge.config._training.TrainingConfig`` is written as ``bridge.config.TrainingConfig``
    (the public path), ``megatron.core.optimizer.optimizer_config.OptimizerConfig`` as
    ``megatron.core.optimizer.OptimizerConfig``, so saved configs survive internal moves.

    Raises:
        ConfigError: ``obj`` cannot be imported by name (a lambda, a local class, ...).
    """
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if module and qualname and "<" not in qualname:
        parts = module.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            mod = sys.modules.get(name)
            if mod is not None and _resolve_attr(mod, qualname) is obj:
                return f"{name}.{qualname}"
    raise ConfigError(
        path,
        f"cannot serialise {_describe(obj)}: it is not importable by a dotted name "
        "(lambdas and locally defined classes or functions are not). Use a module-level "
        "function or class.",
    )


#: Import paths a package moved: old dotted prefix -> new one (see register_moved_import).
_MOVED_IMPORTS: dict[str, str] = {}


def register_moved_import(old: str, new: str) -> None:
    """Let configs saved before a module moved keep loading.

    A ``_target_`` (or any dotted import path in a config) equal to ``old`` or starting with
    ``old + "."`` is read as the same path under ``new``. Packages register their own moves
    when they are imported; saving always writes the current path.

    Args:
        old: The dotted module path (or object path) configs may still name.
        new: Where it lives now.
    """
    _MOVED_IMPORTS[old] = new


def _current_path(dotted: str) -> str:
    for old, new in _MOVED_IMPORTS.items():
        if dotted == old or dotted.startswith(old + "."):
            return new + dotted[len(old) :]
    return dotted


def _import_quietly(name: str) -> Any:
    """Import module ``name``, its third-party import notices held back (logged at DEBUG):
    the first ``_target_`` naming megatron-core imports it, and it prints about seven."""
    from bridge.config.notices import held_notices, log_held_notices

    with held_notices() as held:
        module = importlib.import_module(name)
    log_held_notices(held, logging.getLogger("bridge.config"))
    return module


def import_object(dotted: Any, path: str) -> Any:
    """Import ``package.module.attr.attr`` and return the attribute.

    A path a package has moved (:func:`register_moved_import`) is read at its new place.

    Raises:
        ConfigError: the path is not a string, or its module or attribute does not exist.
    """
    if not isinstance(dotted, str) or not dotted or "." not in dotted:
        raise ConfigError(
            path, f"got {dotted!r}; expected a dotted import path such as 'package.module.Class'"
        )
    dotted = _current_path(dotted)
    parts = dotted.split(".")
    module = None
    split = 0
    for i in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:i])
        if name in sys.modules:
            module, split = sys.modules[name], i
            break
        try:
            module, split = _import_quietly(name), i
            break
        except ModuleNotFoundError as exc:
            # Only "this prefix does not exist" means: try a shorter prefix. A module that
            # exists but fails to import for another reason is reported as it is.
            if exc.name is None or not name.startswith(exc.name):
                raise ConfigError(path, f"importing {name!r} failed: {exc}") from exc
            missing = exc.name
        except Exception as exc:
            raise ConfigError(path, f"importing {name!r} failed: {exc}") from exc
    if module is None:
        raise ConfigError(
            path,
            f"cannot import {dotted!r}: no module named {missing!r}. Install the package that "
            "provides it or fix the path.",
        )
    obj: Any = module
    for depth, attr in enumerate(parts[split:]):
        if not hasattr(obj, attr):
            owner = ".".join(parts[: split + depth])
            choices = [n for n in dir(obj) if not n.startswith("_")]
            raise ConfigError(
                path,
                f"cannot import {dotted!r}: {owner!r} has no attribute {attr!r}."
                + suggest(attr, choices),
            )
        obj = getattr(obj, attr)
    return obj


# ----------------------------------------------------------------------------- encoding


def encode(value: Any, path: str = "", *, strict: bool = True, omit_derived: bool = True) -> Any:
    """Convert ``value`` to plain data (see the module docstring for the tagged forms).

    Runtime hooks and (with ``omit_derived``) derived fields of dataclasses are left out,
    and fields ``validate()`` filled in are written as ``None`` (see
    :func:`fields_left_out`).

    Args:
        value: A config object or any value a config field holds.
        path: Dotted path of ``value``, used in error messages.
        strict: When False, a value that cannot be represented becomes a descriptive string
            instead of raising (used for printing, never for saving).
        omit_derived: Leave out (or write as ``None``) values derived from other fields, by
            the object itself or by ``validate()`` (True for saving; printing shows them).

    Returns:
        Nested dicts, lists and scalars that YAML and OmegaConf can hold.

    Raises:
        ConfigError: ``strict`` and a value cannot be represented so that it loads back.
    """
    try:
        return _encode(value, path, omit_derived)
    except ConfigError:
        if strict:
            raise
        return _encode_lenient(value, path, omit_derived)


def _encode_lenient(value: Any, path: str, omit_derived: bool) -> Any:
    try:
        return _encode(value, path, omit_derived)
    except ConfigError:
        pass
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {TARGET: f"{type(value).__module__}.{type(value).__qualname__}"}
        for name, written in _encoded_fields(value, omit_derived):
            out[name] = (
                _encode_lenient(getattr(value, name), join(path, name), omit_derived)
                if written
                else None
            )
        return out
    if isinstance(value, (list, tuple)):
        return [_encode_lenient(v, f"{path}[{i}]", omit_derived) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {
            str(k): _encode_lenient(v, join(path, str(k)), omit_derived) for k, v in value.items()
        }
    return f"<not serialisable: {_describe(value)}>"


def _is_stateless_callback(value: Any) -> bool:
    # A Callback's module is loaded whenever one exists: no import (and no torch) needed.
    module = sys.modules.get("core_utils.callbacks")
    callback = getattr(module, "Callback", None) if module is not None else None
    return isinstance(callback, type) and isinstance(value, callback) and not vars(value)


def _encode(value: Any, path: str, omit_derived: bool = True) -> Any:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, enum.Enum):
        return {ENUM: f"{import_path(type(value), path)}.{value.name}"}
    if isinstance(value, (int, float, str)):
        return value
    if is_torch_dtype(value):
        return {DTYPE: str(value)}
    if isinstance(value, pathlib.PurePath):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {TARGET: import_path(type(value), path)}
        for name, written in _encoded_fields(value, omit_derived):
            out[name] = (
                _encode(getattr(value, name), join(path, name), omit_derived) if written else None
            )
        return out
    if isinstance(value, functools.partial):
        out = {TARGET: import_path(value.func, path), PARTIAL: True}
        if value.args:
            out[ARGS] = [
                _encode(v, f"{path}.{ARGS}[{i}]", omit_derived) for i, v in enumerate(value.args)
            ]
        for key, kwarg in value.keywords.items():
            out[key] = _encode(kwarg, join(path, key), omit_derived)
        return out
    if isinstance(value, (list, tuple)):
        return [_encode(v, f"{path}[{i}]", omit_derived) for i, v in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        # Sorted by repr so the same set always gives the same file.
        return [
            _encode(v, f"{path}[{i}]", omit_derived) for i, v in enumerate(sorted(value, key=repr))
        ]
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ConfigError(
                    path, f"dict key {key!r} is not a string; only string keys can be saved"
                )
            if key in RESERVED_KEYS:
                raise ConfigError(
                    join(path, key),
                    f"{key!r} is reserved for tagged objects and cannot be a dict key",
                )
            out[key] = _encode(item, join(path, key), omit_derived)
        return out
    if callable(value):
        return {TARGET: import_path(value, path), CALL: False}
    if _is_stateless_callback(value):
        # A stateless training-loop callback is rebuilt by calling its class.
        return {TARGET: import_path(type(value), path)}
    raise ConfigError(
        path,
        f"cannot serialise {_describe(value)} of type {type(value).__qualname__}: only scalars, "
        "lists, dicts, dataclasses, enums, torch dtypes, importable functions/classes and "
        "functools.partial of them can be saved.",
    )


# ----------------------------------------------------------------------------- decoding


def _is_tagged(data: Any) -> bool:
    return isinstance(data, dict) and any(key in data for key in RESERVED_KEYS)


def decode(data: Any, tp: Any, path: str, *, default_class: type | None = None) -> Any:
    """Check ``data`` against the declared type ``tp`` and build the value it describes.

    Args:
        data: Plain data (or an already built object, which is checked and kept).
        tp: The declared type of the field being filled.
        path: Dotted path of the field, used in error messages.
        default_class: Class to build when ``data`` is a dict without ``_target_`` and ``tp``
            is a Protocol.

    Returns:
        The value to store in the field.

    Raises:
        ConfigError: ``data`` does not fit ``tp``.
    """
    if tp is Any or tp is object or isinstance(tp, (str, typing.ForwardRef, typing.TypeVar)):
        return _decode_untyped(data, path)
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return decode(data, typing.get_args(tp)[0], path, default_class=default_class)
    if is_union(tp):
        return _decode_union(data, tp, path, default_class)
    if origin is Literal:
        return _decode_literal(data, tp, path)
    if _is_tagged(data):
        data = _decode_tagged(data, path, expected=tp)
    if origin is not None:
        return _decode_generic(data, tp, origin, path)
    if tp is type(None):
        if data is not None:
            raise _type_error(path, data, "null")
        return None
    if not isinstance(tp, type):
        return _decode_untyped(data, path)
    return _decode_class(data, tp, path, default_class)


def _type_error(path: str, data: Any, expected: str) -> ConfigError:
    return ConfigError(path, f"got {_describe(data)} ({type(data).__name__}); expected {expected}")


def _decode_untyped(data: Any, path: str) -> Any:
    if _is_tagged(data):
        return _decode_tagged(data, path, expected=None)
    if isinstance(data, dict):
        return {key: _decode_untyped(value, join(path, str(key))) for key, value in data.items()}
    if isinstance(data, list):
        return [_decode_untyped(value, f"{path}[{i}]") for i, value in enumerate(data)]
    if isinstance(data, tuple):
        return tuple(_decode_untyped(value, f"{path}[{i}]") for i, value in enumerate(data))
    return data


def _decode_union(data: Any, tp: Any, path: str, default_class: type | None) -> Any:
    args = typing.get_args(tp)
    if data is None:
        if type(None) in args:
            return None
        raise _type_error(path, data, type_name(tp))
    if data == "None" and type(None) in args:
        # YAML and the override grammar read a bare None as this string: a path field would
        # otherwise name a directory called "None".
        raise ConfigError(
            path,
            "got 'None', a string; for no value write null in YAML (None in Python), also "
            "in an override: section.field=null",
        )
    candidates = [a for a in args if a is not type(None)]
    if len(candidates) == 1:
        return decode(data, candidates[0], path, default_class=default_class)
    if isinstance(data, dict) and TARGET in data:
        # The target says which member of the union is meant: check against that one only.
        target = import_object(data[TARGET], join(path, TARGET))
        for candidate in candidates:
            if is_protocol(candidate) or (
                isinstance(target, type)
                and isinstance(candidate, type)
                and issubclass(target, candidate)
            ):
                return decode(data, candidate, path, default_class=default_class)
        raise ConfigError(
            join(path, TARGET),
            f"{data[TARGET]!r} is not one of the accepted classes: {type_name(tp)}",
        )
    if isinstance(data, dict) and not _is_tagged(data):
        # A section dict without _target_: pick the dataclass whose fields cover its keys.
        classes = [a for a in candidates if isinstance(a, type) and dataclasses.is_dataclass(a)]
        fitting = [c for c in classes if set(data) <= {f.name for f in dataclasses.fields(c)}]
        if fitting:
            return decode(data, fitting[0], path)
    errors: list[tuple[Any, ConfigError]] = []
    for candidate in candidates:
        try:
            return decode(data, candidate, path, default_class=default_class)
        except ConfigError as exc:
            errors.append((candidate, exc))
    relevant = [e for _, e in errors if e.location != path]
    if len(relevant) == 1:
        raise relevant[0]
    if not isinstance(data, (dict, list, tuple, str, int, float, bool)):
        # An object of another class: what it lacks of the Protocol is the useful message.
        from_protocol = [e for candidate, e in errors if is_protocol(candidate)]
        if len(from_protocol) == 1:
            raise from_protocol[0]
    raise _type_error(path, data, type_name(tp))


def _decode_literal(data: Any, tp: Any, path: str) -> Any:
    allowed = typing.get_args(tp)
    for option in allowed:
        if type(data) is type(option) and data == option:
            return option
    hint = (
        suggest(data, [a for a in allowed if isinstance(a, str)]) if isinstance(data, str) else ""
    )
    if data == "None" and None in allowed:  # YAML reads a bare None as this string
        hint = " For no value write null in YAML (None in Python)."
    raise ConfigError(
        path, f"got {_describe(data)}; expected one of {', '.join(repr(a) for a in allowed)}.{hint}"
    )


def _decode_generic(data: Any, tp: Any, origin: Any, path: str) -> Any:
    args = typing.get_args(tp)
    if origin in (
        list,
        collections.abc.Sequence,
        collections.abc.Iterable,
        collections.abc.MutableSequence,
    ):
        if not isinstance(data, (list, tuple)):
            raise _type_error(path, data, f"a list ({type_name(tp)})")
        item = args[0] if args else Any
        return [decode(v, item, f"{path}[{i}]") for i, v in enumerate(data)]
    if origin is tuple:
        if not isinstance(data, (list, tuple)):
            raise _type_error(path, data, f"a list ({type_name(tp)})")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(decode(v, args[0], f"{path}[{i}]") for i, v in enumerate(data))
        if args and len(args) != len(data):
            raise ConfigError(
                path,
                f"got {_describe(data)} with {len(data)} items; expected {len(args)} ({type_name(tp)})",
            )
        items = args or (Any,) * len(data)
        return tuple(
            decode(v, t, f"{path}[{i}]") for i, (v, t) in enumerate(zip(data, items, strict=True))
        )
    if origin in (set, frozenset, collections.abc.Set):
        if not isinstance(data, (list, tuple, set, frozenset)):
            raise _type_error(path, data, f"a list ({type_name(tp)})")
        item = args[0] if args else Any
        kind = frozenset if origin in (frozenset, collections.abc.Set) else set
        return kind(decode(v, item, f"{path}[{i}]") for i, v in enumerate(data))
    if origin in (dict, collections.abc.Mapping, collections.abc.MutableMapping):
        if not isinstance(data, dict):
            raise _type_error(path, data, f"a mapping ({type_name(tp)})")
        key_tp, value_tp = args if len(args) == 2 else (Any, Any)
        return {
            decode(k, key_tp, path): decode(v, value_tp, join(path, str(k)))
            for k, v in data.items()
        }
    if origin is collections.abc.Callable:
        return _decode_callable(data, path)
    if origin is type:
        obj = import_object(data, path) if isinstance(data, str) else data
        if not isinstance(obj, type):
            raise _type_error(path, data, "a class")
        return obj
    return _decode_untyped(data, path)


def _decode_callable(data: Any, path: str) -> Any:
    obj = import_object(data, path) if isinstance(data, str) else data
    if not callable(obj):
        raise _type_error(
            path, data, "a callable (a dotted path such as 'torch.nn.functional.gelu')"
        )
    return obj


def _decode_class(data: Any, tp: type, path: str, default_class: type | None) -> Any:
    if tp is bool:
        if isinstance(data, bool):
            return data
        raise _type_error(path, data, "true or false")
    if tp is int:
        if isinstance(data, int) and not isinstance(data, bool):
            return data
        if isinstance(data, float) and data.is_integer():
            return int(data)
        raise _type_error(path, data, "an integer")
    if tp is float:
        if isinstance(data, (int, float)) and not isinstance(data, bool):
            return data  # an int is a valid float (PEP 484); kept as given so it round-trips
        if isinstance(data, str):
            try:
                return float(data)
            except ValueError:
                pass
        raise _type_error(path, data, "a number")
    if tp is str:
        if isinstance(data, str):
            return data
        if isinstance(data, (int, float)) and not isinstance(data, (bool, enum.Enum)):
            return str(data)
        raise _type_error(path, data, "a string")
    if issubclass(tp, pathlib.PurePath):
        if isinstance(data, (str, pathlib.PurePath)):
            return tp(data)
        raise _type_error(path, data, "a path")
    if is_torch_dtype_type(tp):
        return _decode_dtype(data, path)
    if issubclass(tp, enum.Enum):
        return _decode_enum_value(data, tp, path)
    if is_protocol(tp):
        return _decode_protocol(data, tp, path, default_class)
    if isinstance(data, tp):
        return data
    if isinstance(data, dict) and dataclasses.is_dataclass(tp):
        return build_dataclass(tp, data, path)
    if tp is collections.abc.Callable:
        return _decode_callable(data, path)
    raise _type_error(path, data, type_name(tp))


def _decode_protocol(data: Any, tp: type, path: str, default_class: type | None) -> Any:
    if isinstance(data, dict):
        if default_class is None:
            raise ConfigError(
                join(path, TARGET),
                f"missing; a {tp.__name__} section needs '_target_: package.module.Class' naming "
                "the class to build",
            )
        data = build_dataclass(default_class, data, path)
    if data is None or isinstance(data, (bool, int, float, str, list, tuple)):
        raise _type_error(path, data, f"an object providing {tp.__name__}")
    missing = missing_protocol_members(data, tp)
    if missing:
        raise ConfigError(
            path,
            f"{type(data).__qualname__} does not provide {tp.__name__}: it lacks {', '.join(missing)}",
        )
    return data


def _decode_dtype(data: Any, path: str) -> Any:
    if is_torch_dtype(data):
        return data
    if isinstance(data, dict) and set(data) == {DTYPE}:
        data = data[DTYPE]
    if isinstance(data, str):
        import torch

        value = getattr(torch, data.removeprefix("torch."), None)
        if isinstance(value, torch.dtype):
            return value
    raise _type_error(path, data, "a torch dtype such as 'bfloat16' or {_dtype_: torch.float32}")


def _decode_enum_value(data: Any, tp: type[enum.Enum], path: str) -> Any:
    if isinstance(data, tp):
        return data
    if isinstance(data, str) and data in tp.__members__:
        return tp[data]
    try:
        return tp(data)
    except (ValueError, TypeError):
        pass
    names = list(tp.__members__)
    hint = suggest(data, names) if isinstance(data, str) else ""
    raise ConfigError(
        path,
        f"got {_describe(data)}; expected a member of {tp.__qualname__}: {', '.join(names)}.{hint}",
    )


def _decode_tagged(data: dict[str, Any], path: str, expected: Any) -> Any:
    if DTYPE in data:
        if set(data) != {DTYPE}:
            raise ConfigError(path, f"a {DTYPE} tag takes no other keys, got {sorted(data)}")
        return _decode_dtype(data, path)
    if ENUM in data:
        if set(data) != {ENUM}:
            raise ConfigError(path, f"an {ENUM} tag takes no other keys, got {sorted(data)}")
        dotted = data[ENUM]
        if not isinstance(dotted, str) or "." not in dotted:
            raise ConfigError(
                join(path, ENUM), f"got {dotted!r}; expected 'package.module.Enum.MEMBER'"
            )
        owner_path, member = dotted.rsplit(".", 1)
        owner = import_object(owner_path, join(path, ENUM))
        if not (isinstance(owner, type) and issubclass(owner, enum.Enum)):
            raise ConfigError(join(path, ENUM), f"{owner_path!r} is not an enum class")
        return _decode_enum_value(member, owner, join(path, ENUM))
    return instantiate(data, path, expected=expected)


def instantiate(data: dict[str, Any], path: str, expected: Any = None) -> Any:
    """Build the object a ``{_target_: ...}`` dict describes.

    Args:
        data: The tagged dict.
        path: Dotted path of the value, used in error messages.
        expected: The declared type of the field, if known; a class ``_target_`` must be a
            subclass of it.

    Returns:
        The built object, the imported callable (``_call_: false``) or a partial.

    Raises:
        ConfigError: the target cannot be imported, does not fit ``expected``, or rejects
            the given values.
    """
    target = import_object(data[TARGET], join(path, TARGET))
    extra = {k: v for k, v in data.items() if k not in (TARGET, CALL, PARTIAL, ARGS)}
    if data.get(CALL) is False:
        if extra or PARTIAL in data or ARGS in data:
            raise ConfigError(
                path,
                f"'{CALL}: false' names a callable and takes no other keys, got {sorted(extra)}",
            )
        return target
    if (
        isinstance(target, type)
        and isinstance(expected, type)
        and not is_protocol(expected)
        and not is_torch_dtype_type(expected)
        and expected not in (int, float, str, bool)
        and not issubclass(target, expected)
    ):
        raise ConfigError(
            join(path, TARGET),
            f"{data[TARGET]!r} is not a {expected.__qualname__}; expected a subclass of "
            f"{type_name(expected)}",
        )
    if isinstance(target, type) and is_protocol(expected):
        provided = set(dir(target))
        for klass in target.__mro__:
            provided |= set(vars(klass).get("__annotations__", {}))
        missing = [name for name in protocol_members(expected) if name not in provided]
        if missing:
            raise ConfigError(
                join(path, TARGET),
                f"{data[TARGET]!r} does not provide {expected.__name__}: it lacks {', '.join(missing)}",
            )
    args_data = data.get(ARGS, [])
    if not isinstance(args_data, list):
        raise _type_error(join(path, ARGS), args_data, "a list")
    args = [_decode_untyped(v, f"{path}.{ARGS}[{i}]") for i, v in enumerate(args_data)]
    if data.get(PARTIAL):
        kwargs = {k: _decode_untyped(v, join(path, k)) for k, v in extra.items()}
        return functools.partial(target, *args, **kwargs)
    if isinstance(target, type) and dataclasses.is_dataclass(target) and not args:
        return build_dataclass(target, extra, path)
    if not callable(target):
        raise ConfigError(join(path, TARGET), f"{data[TARGET]!r} is not callable")
    kwargs = {k: _decode_untyped(v, join(path, k)) for k, v in extra.items()}
    try:
        return target(*args, **kwargs)
    except ConfigError as exc:
        raise exc.within(path, getattr(target, "__name__", None)) from exc
    except Exception as exc:
        raise ConfigError(path, f"{data[TARGET]} rejected these values: {exc}") from exc


#: Set by ``load_config`` (recipes and command-line overrides: what a user types): a value
#: for a field ``validate()`` computes is refused there. ``from_dict``/``from_yaml`` of a
#: config saved from Python keep accepting such values, so those round-trip.
REFUSE_DERIVED_VALUES: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "REFUSE_DERIVED_VALUES", default=False
)

#: What the user sets instead of each field ``ConfigContainer.validate()`` computes.
DERIVED_FROM = {
    "data_parallel_size": "it is the world size divided by the model-parallel sizes; launch "
    "more or fewer ranks or change model.tensor_model_parallel_size / "
    "pipeline_model_parallel_size / context_parallel_size",
    "lr_decay_steps": "set scheduler.lr_decay_iters (or lr_decay_samples) instead",
    "lr_warmup_steps": "set scheduler.lr_warmup_iters, lr_warmup_samples or lr_warmup_fraction",
    "wd_incr_steps": "it follows train.train_iters (or train.train_samples)",
    "wsd_decay_steps": "set scheduler.lr_wsd_decay_iters (or lr_wsd_decay_samples) instead",
}


def build_dataclass(cls: type, data: dict[str, Any], path: str) -> Any:
    """Build dataclass ``cls`` from a dict of field values, checking every value's type.

    Keys naming ``init=False`` fields (derived values a saved config carries, such as the
    scheduler steps ``validate()`` fills) are set after construction, and bridge.config
    sections then re-run their checks on the complete state.

    Raises:
        ConfigError: an unknown key (with a did-you-mean suggestion), a missing required
            field, a value of the wrong type, or a value the class rejects.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = field_types(cls)
    kwargs: dict[str, Any] = {}
    derived: dict[str, Any] = {}
    for key, raw in data.items():
        if key == TARGET:
            continue
        field = fields.get(key) if isinstance(key, str) and not key.startswith("_") else None
        if field is None:
            raise ConfigError(join(path, str(key)), unknown_key_detail(cls, str(key), fields))
        try:
            value = decode(
                raw,
                hints.get(key, Any),
                join(path, key),
                default_class=field.metadata.get(DEFAULT_CLASS),
            )
        except ConfigError as exc:
            if field.init or exc.location != join(path, key):
                raise
            raise ConfigError(
                exc.location,
                f"is fixed by {cls.__qualname__} and cannot be set to {_describe(raw)}",
            ) from None
        if (
            REFUSE_DERIVED_VALUES.get()
            and not field.init
            and value is not None
            and cls.__module__.startswith(_OWN_PACKAGE)
        ):
            # A saved config writes these as null; a value here was typed by a user.
            raise ConfigError(
                join(path, key),
                f"got {_describe(raw)}; it is computed by validate() and cannot be set: "
                f"{DERIVED_FROM.get(key, 'remove it')}",
            )
        (kwargs if field.init else derived)[key] = value
    for field in fields.values():
        required = (
            field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        )
        if field.init and required and field.name not in kwargs:
            raise ConfigError(
                join(path, field.name),
                f"required field of {cls.__qualname__} is missing ({type_name(hints.get(field.name, Any))})",
            )
    obj = _construct(cls, kwargs, path)
    if derived:
        for key, value in derived.items():
            object.__setattr__(obj, key, value)
        if cls.__module__.startswith(_OWN_PACKAGE) and hasattr(obj, "__post_init__"):
            _construct_step(obj.__post_init__, cls, path)
    return obj


def _construct(cls: type, kwargs: dict[str, Any], path: str) -> Any:
    return _construct_step(lambda: cls(**kwargs), cls, path)


def _construct_step(step: Any, cls: type, path: str) -> Any:
    from bridge.config.notices import held_notices, log_held_notices

    try:
        # A third-party class may warn about its own defaults (megatron-core's
        # TransformerConfig: "full scope is deprecated"): held back, logged at DEBUG.
        with held_notices() as held:
            built = step()
        log_held_notices(held, logging.getLogger("bridge.config"))
        return built
    except ConfigError as exc:
        raise exc.within(path, cls.__name__) from exc.__cause__
    except Exception as exc:
        message = str(exc) or type(exc).__name__
        raise ConfigError(
            path or cls.__name__, f"{cls.__qualname__} rejected these values: {message}"
        ) from exc


def normalize_fields(obj: Any) -> None:
    """Check every field of a bridge.config section against its annotation, in place.

    Values are converted where that is lossless (``1`` to ``1.0`` for a float field, a list
    to a tuple, a string to a ``Path``), so a section built in Python holds the same values
    as one loaded from YAML. Float fields (also inside lists, tuples and dicts typed as
    holding floats) must be finite: comparisons with NaN are always false, so a NaN would
    pass every range check, and no section documents infinity as a valid value.

    Raises:
        ConfigError: a field holds a value its annotation does not allow, or NaN or an
            infinity where a float is expected.
    """
    cls = type(obj)
    hints = field_types(cls)
    for field in dataclasses.fields(obj):
        current = getattr(obj, field.name)
        path = f"{cls.__name__}.{field.name}"
        hint = hints.get(field.name, Any)
        value = decode(current, hint, path, default_class=field.metadata.get(DEFAULT_CLASS))
        where = _non_finite(value, hint)
        if where is not None:
            suffix, bad = where
            raise ConfigError(
                path + suffix,
                f"got {bad!r}; expected a finite number (NaN and infinity are not valid here)",
            )
        if value is not current:
            object.__setattr__(obj, field.name, value)


def _non_finite(value: Any, tp: Any) -> tuple[str, float] | None:
    """Where a float-typed part of ``value`` is NaN or infinite: (path suffix, value)."""
    if tp is float:
        if isinstance(value, float) and not math.isfinite(value):
            return "", value
        return None
    if is_union(tp):
        for option in typing.get_args(tp):
            found = _non_finite(value, option)
            if found is not None:
                return found
        return None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return _non_finite(value, args[0])
    items: list[tuple[str, Any, Any]] = []
    if isinstance(value, dict) and origin in (dict, collections.abc.Mapping) and len(args) == 2:
        items = [(f".{key}", item, args[1]) for key, item in value.items()]
    elif isinstance(value, (list, tuple, set, frozenset)) and args:
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            kinds = list(args)
        else:
            kinds = [args[0]] * len(value)
        items = [
            (f"[{i}]", item, kind) for i, (item, kind) in enumerate(zip(value, kinds, strict=False))
        ]
    for suffix, item, kind in items:
        found = _non_finite(item, kind)
        if found is not None:
            return suffix + found[0], found[1]
    return None
