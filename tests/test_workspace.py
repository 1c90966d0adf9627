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


def test_no_all_lists_a_private_name() -> None:
    """``__all__`` is the public API: a ``_``-name in it is a contradiction.

    (docs/architecture.md, "Public API".)
    """
    offenders = []
    for dist in sorted(ALLOWED_SIBLINGS):
        for path in sorted((PACKAGES / dist / "src").rglob("*.py")):
            for node in _parse(path).body:
                if not (
                    isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
                ):
                    continue
                for name in _all_names(path, node.value):
                    if name.startswith("_"):
                        offenders.append(f"{path.relative_to(ROOT)}: __all__ lists {name}")
    assert not offenders, "\n".join(offenders)


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
