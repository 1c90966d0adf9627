"""The public API and the import rules of bridge.resiliency."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import bridge.resiliency

SOURCE = Path(bridge.resiliency.__file__).parent
# Optional or forbidden at import time: the extra is imported where a switched-on feature
# needs it; megatron-core and the sibling packages are never imported (docs/architecture.md).
NOT_AT_MODULE_LEVEL = ("nvidia_resiliency_ext", "megatron")
NEVER = ("bridge.train", "bridge.logging", "bridge.mimo", "megatron")


def test_every_public_name_is_importable_and_documented() -> None:
    assert sorted(bridge.resiliency.__all__) == sorted(set(bridge.resiliency.__all__))
    for name in bridge.resiliency.__all__:
        obj = getattr(bridge.resiliency, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert inspect.getdoc(obj), f"{name} has no docstring"


def _imports(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [node.module]
    return []


def test_optional_backends_are_imported_only_inside_functions() -> None:
    offenders = []
    for path in sorted(SOURCE.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        module_level = [n for n in tree.body if not isinstance(n, ast.FunctionDef | ast.ClassDef)]
        for top in module_level:
            for node in ast.walk(top):
                for name in _imports(node):
                    assert isinstance(node, ast.Import | ast.ImportFrom)  # for mypy: has lineno
                    if name.split(".")[0] in NOT_AT_MODULE_LEVEL:
                        offenders.append(f"{path.name}:{node.lineno} imports {name} at import time")
        for node in ast.walk(tree):
            for name in _imports(node):
                assert isinstance(node, ast.Import | ast.ImportFrom)  # for mypy: has lineno
                if any(name == n or name.startswith(n + ".") for n in NEVER):
                    offenders.append(f"{path.name}:{node.lineno} imports {name}")
    assert not offenders, "\n".join(offenders)


def test_the_watchdog_process_needs_only_the_standard_library() -> None:
    tree = ast.parse((SOURCE / "_watchdog_process.py").read_text())
    imported = {name.split(".")[0] for node in ast.walk(tree) for name in _imports(node)}
    assert imported <= {"__future__", "os", "select", "signal", "sys", "time"}, imported
