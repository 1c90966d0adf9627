"""Guards on the shape of the workspace: namespace, package edges, wheels."""

from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ROOT / "packages"
VERSION = "0.1.0"

# The only edges allowed between distributions (docs/architecture.md, "The package graph").
ALLOWED_SIBLINGS: dict[str, set[str]] = {
    "core-utils": set(),
    "bridge-config": {"core-utils"},
    "bridge-logging": {"core-utils", "bridge-config"},
    "bridge-resiliency": {"core-utils", "bridge-config"},
    "bridge-mimo": {"core-utils", "bridge-config"},
    "bridge-train": {
        "core-utils",
        "bridge-config",
        "bridge-logging",
        "bridge-resiliency",
        "bridge-mimo",
    },
}
IMPORT_NAME = {
    "core-utils": "core_utils",
    "bridge-config": "bridge.config",
    "bridge-logging": "bridge.logging",
    "bridge-resiliency": "bridge.resiliency",
    "bridge-mimo": "bridge.mimo",
    "bridge-train": "bridge.train",
}


@functools.cache
def _parse(path: Path) -> ast.Module:
    # Parsed once per session: several guards walk the same sources.
    return ast.parse(path.read_text(), filename=str(path))


def _requirement_name(req: str) -> str:
    for sep in "[=<>!~; ":
        req = req.split(sep, 1)[0]
    return req.strip()


def _project(dist: str) -> dict:
    return tomllib.loads((PACKAGES / dist / "pyproject.toml").read_text())["project"]


def test_every_distribution_is_present() -> None:
    assert sorted(p.name for p in PACKAGES.iterdir() if p.is_dir()) == sorted(ALLOWED_SIBLINGS)


def test_bridge_is_a_namespace_package_everywhere() -> None:
    stray = sorted(str(p.relative_to(ROOT)) for p in PACKAGES.glob("*/src/bridge/__init__.py"))
    assert not stray, f"bridge/ must stay a PEP 420 namespace; delete {stray}"
    import bridge

    assert getattr(bridge, "__file__", None) is None
    assert len(list(bridge.__path__)) == 5


@pytest.mark.parametrize("dist", sorted(ALLOWED_SIBLINGS))
def test_declared_sibling_dependencies_follow_the_package_graph(dist: str) -> None:
    project = _project(dist)
    assert project["version"] == VERSION
    requirements = list(project.get("dependencies", []))
    siblings = {_requirement_name(r) for r in requirements} & set(ALLOWED_SIBLINGS)
    assert siblings == ALLOWED_SIBLINGS[dist]
    for req in requirements:
        if _requirement_name(req) in ALLOWED_SIBLINGS:
            assert req.endswith(f"=={VERSION}"), f"{dist}: pin sibling exactly: {req}"


@pytest.mark.parametrize("dist", sorted(ALLOWED_SIBLINGS))
def test_sources_import_only_declared_siblings(dist: str) -> None:
    """A distribution's code imports no sibling it does not declare (checked statically)."""
    allowed = {IMPORT_NAME[d] for d in ALLOWED_SIBLINGS[dist] | {dist}}
    forbidden = set(IMPORT_NAME.values()) - allowed
    offenders = []
    for path in (PACKAGES / dist / "src").rglob("*.py"):
        for node in ast.walk(_parse(path)):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                if any(name == f or name.startswith(f + ".") for f in forbidden):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert not offenders, "\n".join(offenders)


def test_importing_core_utils_loads_no_megatron_or_optional_package() -> None:
    code = (
        "import sys, core_utils, bridge.config\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('megatron', 'transformer_engine', 'flash_attn', 'mamba_ssm', 'causal_conv1d', "
        "'wandb', 'mlflow', 'comet_ml', 'pynvml', 'nvidia_resiliency_ext', 'apex')]\n"
        "print(bad); assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.slow
def test_each_distribution_builds_a_wheel_with_only_its_leaf(tmp_path: Path) -> None:
    for dist, import_name in IMPORT_NAME.items():
        out = tmp_path / dist
        subprocess.run(
            [
                os.environ.get("UV", "uv"),
                "build",
                "--wheel",
                "--package",
                dist,
                "--out-dir",
                str(out),
                "--quiet",
            ],
            cwd=ROOT,
            check=True,
            timeout=300,
        )
        (wheel,) = out.glob("*.whl")
        names = zipfile.ZipFile(wheel).namelist()
        leaf = import_name.replace(".", "/") + "/"
        top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
        assert top_level == {import_name.split(".")[0]}, (dist, top_level)
        assert any(n.startswith(leaf) for n in names), (dist, leaf)
        assert "bridge/__init__.py" not in names
        assert all(n.startswith(leaf) or ".dist-info/" in n for n in names), dist


def _owner(module: str) -> str | None:
    for dist, import_name in IMPORT_NAME.items():
        if module == import_name or module.startswith(import_name + "."):
            return dist
    return None


def _dotted(node: ast.expr) -> str:
    """``a.b.c`` for a chain of attribute accesses on a name, else ``""``."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    return ".".join([node.id, *reversed(parts)])


def _all_names(path: Path, value: ast.expr) -> list[str]:
    """An ``__all__`` written as a literal list, or derived from a literal table (the
    package's value then comes from importing it)."""
    try:
        return list(ast.literal_eval(value))
    except ValueError:
        import importlib

        parts = path.with_suffix("").parts[path.parts.index("src") + 1 :]
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        return list(importlib.import_module(module).__all__)


def _is_private(name: str) -> bool:
    # A dunder (``__straggler__``, ``__version__``) is a protocol name, not a private one.
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _all_values(path: Path) -> list[ast.expr]:
    """The values assigned to ``__all__`` at the top level of ``path`` (``__all__ = ...`` or
    ``__all__: list[str] = ...``)."""
    values: list[ast.expr] = []
    for node in _parse(path).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            values.append(value)
    return values


def test_no_all_lists_a_private_name() -> None:
    """``__all__`` is the public API: a ``_``-name in it is a contradiction.

    (docs/architecture.md, "Public API".)
    """
    offenders = []
    for dist in sorted(ALLOWED_SIBLINGS):
        for path in sorted((PACKAGES / dist / "src").rglob("*.py")):
            for value in _all_values(path):
                for name in _all_names(path, value):
                    if name.startswith("_"):
                        offenders.append(f"{path.relative_to(ROOT)}: __all__ lists {name}")
    assert not offenders, "\n".join(offenders)


def test_every_public_module_defines_all() -> None:
    """Each public module states its public API in ``__all__`` (docs/architecture.md,
    "Public API"): every module under ``packages/*/src`` whose name and folders do not start
    with ``_``, and every package ``__init__.py``. ``__main__.py`` files are entry points
    (``python -m``), not APIs, and need none."""
    offenders = []
    for dist in sorted(ALLOWED_SIBLINGS):
        src = PACKAGES / dist / "src"
        for path in sorted(src.rglob("*.py")):
            parts = path.relative_to(src).parts
            if path.name == "__main__.py" or any(
                _is_private(part.removesuffix(".py")) for part in parts
            ):
                continue
            if not _all_values(path):
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, "modules without __all__:\n" + "\n".join(offenders)


@pytest.mark.parametrize("dist", sorted(ALLOWED_SIBLINGS))
def test_no_distribution_uses_a_private_name_of_another(dist: str) -> None:
    """``from x._y import``, ``from x import _name`` and ``x._name`` stay inside x's owner."""
    offenders = []
    for path in sorted((PACKAGES / dist / "src").rglob("*.py")):
        for node in ast.walk(_parse(path)):
            used: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if _owner(node.module) not in (None, dist):
                    parts = node.module.split(".") + [a.name for a in node.names]
                    used = [f"{node.module}: {p}" for p in parts if _is_private(p)]
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if _owner(alias.name) not in (None, dist):
                        used += [alias.name for p in alias.name.split(".") if _is_private(p)]
            elif isinstance(node, ast.Attribute) and _is_private(node.attr):
                owner = _owner(_dotted(node.value))
                if owner not in (None, dist):
                    used = [f"{_dotted(node.value)}.{node.attr}"]
            offenders += [
                f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)} uses {u}" for u in used
            ]
    assert not offenders, "\n".join(offenders)


def _modules(dist: str) -> dict[str, Path]:
    """Dotted name -> source file of every module of ``dist`` (packages by their __init__)."""
    src = PACKAGES / dist / "src"
    modules = {}
    for path in sorted(src.rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return _dotted(test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported: its body, including ``if``/``try``
    blocks, but not functions, classes or ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                todo += node.body
            todo += node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody
            for handler in node.handlers:
                todo += handler.body
        elif isinstance(node, ast.With):
            todo += node.body
    return found


def _import_edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of the same distribution that importing ``name`` imports at once: the
    module an import names (``from a.b import c`` names ``a.b.c`` when that is a module,
    else ``a.b``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges: set[str] = set()
    for node in _module_level_imports(_parse(path)):
        if isinstance(node, ast.Import):
            edges.update(alias.name for alias in node.names if alias.name in modules)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join([*anchor, *([base] if base else [])])
        for alias in node.names:
            target = f"{base}.{alias.name}"
            if target in modules:
                edges.add(target)
            elif base in modules:
                edges.add(base)
    edges.discard(name)
    return edges


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize("dist", sorted(ALLOWED_SIBLINGS))
def test_no_module_level_import_cycle(dist: str) -> None:
    """No two modules of a distribution import each other, directly or through others, when
    they are imported (imports inside functions and under ``TYPE_CHECKING`` do not count).

    A cycle makes a module's names depend on which module is imported first; shared types
    belong in a module both import (bridge-train: ``state.py``).
    """
    modules = _modules(dist)
    graph = {name: _import_edges(name, path, modules) for name, path in modules.items()}
    cycles = _cycles(graph)
    assert not cycles, "module-level import cycles:\n" + "\n".join(
        " <-> ".join(cycle) for cycle in cycles
    )


def test_the_cycle_guard_sees_a_cycle(tmp_path: Path) -> None:
    """The guard above on a made-up package: ``a`` and ``b`` import each other at module
    level (``from`` and relative forms); ``c`` imports ``a`` only inside a function and
    under ``TYPE_CHECKING``."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import thing\n")
    (pkg / "b.py").write_text("try:\n    from . import a\nexcept ImportError:\n    pass\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n"
        "def f():\n    import pkg.a\n"
    )
    modules = {
        "pkg": pkg / "__init__.py",
        "pkg.a": pkg / "a.py",
        "pkg.b": pkg / "b.py",
        "pkg.c": pkg / "c.py",
    }
    graph = {name: _import_edges(name, path, modules) for name, path in modules.items()}
    assert graph["pkg.c"] == set()
    assert _cycles(graph) == [["pkg.a", "pkg.b"]]
