"""Reading and writing config YAML files, and OmegaConf interpolation."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from bridge.config._errors import ConfigError
from bridge.config.atomic_files import atomic_write

# A run of backslashes right before "${": OmegaConf reads "\${" as a literal "${" and "\\"
# before "${" as one literal backslash, so both need escaping to survive a load.
_INTERPOLATION_START = re.compile(r"(\\*)\$\{")


def escape_interpolations(data: Any) -> Any:
    """Escape ``${`` in every string so OmegaConf loads it back as literal text."""
    if isinstance(data, str):
        if "${" not in data:
            return data
        return _INTERPOLATION_START.sub(lambda m: "\\" * (2 * len(m.group(1)) + 1) + "${", data)
    if isinstance(data, dict):
        return {key: escape_interpolations(value) for key, value in data.items()}
    if isinstance(data, list):
        return [escape_interpolations(value) for value in data]
    return data


def _mentions_interpolation(data: Any) -> bool:
    if isinstance(data, str):
        return "${" in data
    if isinstance(data, dict):
        return any(_mentions_interpolation(v) for v in data.values())
    if isinstance(data, list):
        return any(_mentions_interpolation(v) for v in data)
    return False


def resolve_interpolations(data: dict[str, Any], source: str) -> dict[str, Any]:
    """Resolve OmegaConf interpolations (``${model.seq_length}``) and escapes in ``data``.

    Args:
        data: Plain nested data as loaded from YAML.
        source: What the data came from, for error messages (a file path or "overrides").

    Returns:
        The same structure with every interpolation replaced by its value.

    Raises:
        ConfigError: an interpolation names a key that does not exist or is malformed.
    """
    if not _mentions_interpolation(data):
        return data  # nothing for OmegaConf to do; skipping it keeps loading fast
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        resolved = OmegaConf.to_container(OmegaConf.create(data), resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or source
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(str(key), f"cannot resolve interpolation: {message}") from None
    assert isinstance(resolved, dict)
    return resolved


def _interpolated_values(data: Any, prefix: str = "") -> dict[str, str]:
    if isinstance(data, str):
        return {prefix: data} if _INTERPOLATION_START.search(data) else {}
    if isinstance(data, dict):
        found: dict[str, str] = {}
        for key, value in data.items():
            found.update(_interpolated_values(value, f"{prefix}.{key}" if prefix else str(key)))
        return found
    return {}


@contextlib.contextmanager
def naming_interpolation_sources(data: dict[str, Any]) -> Iterator[None]:
    """Inside, a ConfigError about a value ``data`` took from an interpolation names it.

    A recipe writes ``dataset.sequence_length: ${model.seq_length}``; when the user sets
    ``model.seq_length=0``, the dataset section is the one that refuses the value, and
    without this the message would send them to a field they never touched.

    Args:
        data: The unresolved data, as read from YAML with the overrides merged in.
    """
    sources = _interpolated_values(data)
    try:
        yield
    except ConfigError as exc:
        source = sources.get(exc.location)
        if source is None:
            raise
        raise ConfigError(
            exc.location, f"{exc.detail} (the value comes from {source}: change that instead)"
        ) from exc.__cause__


def read_yaml_mapping(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML file whose top level is a mapping.

    Raises:
        ConfigError: the file does not exist, cannot be read, does not parse (the message
            gives the line and column), or its top level is not a mapping.
    """
    file = Path(path)
    if not file.is_file():
        what = "is a directory, not a YAML file" if file.is_dir() else "does not exist"
        raise ConfigError(str(file), f"config file {what}")
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(file), f"cannot read config file: {exc}") from None
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(str(file), f"invalid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            str(file),
            f"the top level must be a mapping of sections (train:, model:, ...), got {type(data).__name__}",
        )
    _check_expanded_size(data, file)
    return data


#: Values a config may hold once its YAML aliases are expanded. A recipe holds a few hundred;
#: aliases of aliases ("billion laughs") reach billions from a few lines, and every later
#: walk over the data (overrides, interpolations, validation) would take that long.
MAX_EXPANDED_VALUES = 1_000_000


def _check_expanded_size(data: Any, file: Path) -> None:
    """Refuse data whose aliases expand past :data:`MAX_EXPANDED_VALUES`, or into themselves.

    PyYAML builds an alias as a reference to the anchored object, so loading is fast and the
    size is counted per distinct object (memoised), in time linear in the file.
    """
    sizes: dict[int, int] = {}
    open_ids: set[int] = set()

    def size(value: Any) -> int:
        if not isinstance(value, (dict, list)):
            return 1
        key = id(value)
        known = sizes.get(key)
        if known is not None:
            return known
        if key in open_ids:
            raise ConfigError(str(file), "a YAML alias refers to itself (a recursive anchor)")
        open_ids.add(key)
        items = value.values() if isinstance(value, dict) else value
        total = 1
        for item in items:
            total += size(item)
            if total > MAX_EXPANDED_VALUES:
                raise ConfigError(
                    str(file),
                    f"its YAML aliases expand to more than {MAX_EXPANDED_VALUES:,} values "
                    "(aliases of aliases); write the values out or use fewer nested aliases",
                )
        open_ids.discard(key)
        sizes[key] = total
        return total

    size(data)


_MERGE_TAG = "tag:yaml.org,2002:merge"


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """SafeLoader (libyaml's C parser when PyYAML has it) that refuses a key given twice in
    one mapping: PyYAML keeps the last one silently. Keys a ``<<`` merge brings in may be
    overridden, as YAML intends."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                first = seen[key].start_mark.line + 1
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (first given on line {first}); keep one",
                    key_node.start_mark,
                )
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


class _Dumper(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):  # type: ignore[misc]
    """SafeDumper that double-quotes strings holding Unicode line separators.

    PyYAML may pick a style in which a lone NEL (U+0085) reads back as a space; in double
    quotes it is escaped, so every string loads back exactly.
    """


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    if any(ch in value for ch in "\x85\u2028\u2029"):
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style='"')
    return dumper.represent_str(value)


_Dumper.add_representer(str, _represent_str)


def dump_yaml(data: Any) -> str:
    """Render plain data as block-style YAML, keeping key order; strings load back exactly."""
    return yaml.dump(
        data,
        Dumper=_Dumper,
        sort_keys=False,
        default_flow_style=False,
        allow_unicode=True,
        width=100,
    )


def write_new_file(path: str | os.PathLike[str], text: str, *, overwrite: bool) -> None:
    """Write ``text`` to ``path`` atomically, refusing to replace a file unless told to.

    See :func:`bridge.config.atomic_files.atomic_write`: a crash never leaves a half-written
    config behind, and a new file gets the usual (umask-derived) mode.

    Raises:
        ConfigError: the file exists and ``overwrite`` is False, or writing fails.
    """
    file = Path(path)
    already = ConfigError(str(file), "file already exists; pass overwrite=True to replace it")
    if file.exists() and not overwrite:
        raise already
    if file.is_dir():
        raise ConfigError(str(file), "is a directory; give a file path")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(file, text, overwrite=overwrite)
    except FileExistsError:
        raise already from None
    except OSError as exc:
        raise ConfigError(str(file), f"cannot write config file: {exc}") from None
