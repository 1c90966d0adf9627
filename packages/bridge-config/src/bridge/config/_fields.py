"""Field documentation read from the attribute docstrings under each dataclass field."""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import inspect
import itertools
import textwrap
from typing import Any

from bridge.config._typing import field_types, type_name

#: dataclass field metadata key: how to show a default that is computed at construction.
DEFAULT_DOC = "bridge_config_default_doc"


@dataclasses.dataclass(frozen=True)
class FieldInfo:
    """Documentation of one dataclass field.

    Attributes:
        name: Field name.
        type: The annotation as a user writes it (``Optional[int]``, ``Literal['a', 'b']``).
        default: The default rendered as text; ``"required"`` when there is none.
        doc: The docstring written under the field ("" when it has none).
        settable: False for derived fields (``init=False``) that cannot be set.
    """

    name: str
    type: str
    default: str
    doc: str
    settable: bool


@functools.cache
def _attribute_docs(cls: type) -> dict[str, str]:
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        tree = ast.parse(source)
        node = next((n for n in tree.body if isinstance(n, ast.ClassDef)), None)
        if node is None:
            continue
        body = node.body
        for current, following in itertools.pairwise(body):
            if (
                isinstance(current, ast.AnnAssign)
                and isinstance(current.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[current.target.id] = inspect.cleandoc(following.value.value)
    return docs


def render_value(value: Any) -> str:
    """Render a default value the way it is written in YAML or Python."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, type):
        return f"{value.__qualname__}()"
    if dataclasses.is_dataclass(value):
        return f"{type(value).__qualname__}()"
    return repr(value)


def _render_default(f: dataclasses.Field[Any]) -> str:
    if DEFAULT_DOC in f.metadata:
        return str(f.metadata[DEFAULT_DOC])
    if f.default is not dataclasses.MISSING:
        return render_value(f.default)
    if f.default_factory is not dataclasses.MISSING:
        factory = f.default_factory
        if isinstance(factory, type):
            return f"{factory.__qualname__}()"
        return render_value(factory())
    return "required"


def describe_fields(cls: type) -> list[FieldInfo]:
    """Describe every public field of a config dataclass: name, type, default and docstring.

    Args:
        cls: A dataclass (a bridge.config section, or any dataclass with docstrings under
            its fields, such as megatron-core's configs).

    Returns:
        One ``FieldInfo`` per field, in definition order.

    Raises:
        TypeError: ``cls`` is not a dataclass.
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"describe_fields expects a dataclass, got {cls!r}")
    docs = _attribute_docs(cls)
    hints = field_types(cls)
    return [
        FieldInfo(
            name=f.name,
            type=type_name(hints[f.name]),
            default=_render_default(f),
            doc=docs.get(f.name, ""),
            settable=f.init,
        )
        for f in dataclasses.fields(cls)
        if not f.name.startswith("_")
    ]
