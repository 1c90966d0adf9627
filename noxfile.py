"""Test sessions for the workspace.

Each ``tests(<dist>)`` session syncs one distribution, its declared dependencies and the
extras listed below into a venv of its own, then runs that distribution's tests. A test
that passes there proves the distribution installs and works without its siblings.

Run everything with ``uv run nox``; one session with ``uv run nox -s "tests(core-utils)"``.
"""

from __future__ import annotations

import os

import nox

# Machines of this kind export PYTHONDONTWRITEBYTECODE=1, so every process would recompile
# torch and megatron-core from source on import (~23 s instead of ~9 s per rank). Let
# Python cache bytecode in each session's venv; every test process after the first reuses it.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

nox.options.default_venv_backend = "uv"
nox.options.error_on_missing_interpreters = True

# Extras each distribution is tested with. bridge-resiliency gets the real
# nvidia-resiliency-ext; that wheel cannot share a venv with megatron-core 0.19
# (see docs/resiliency.md), which is why only this session installs it.
DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "core-utils": (),
    "bridge-config": (),
    "bridge-logging": ("tensorboard", "wandb", "mlflow", "comet"),
    "bridge-resiliency": ("nvrx",),
    "bridge-mimo": (),
    "bridge-train": ("hf", "sentencepiece", "tiktoken"),
}

PYTEST_ARGS = ("-c", "pyproject.toml", "--durations=10")

# Distributions whose tests/ directory the lint session type-checks. Test directories have
# no __init__.py and repeat module names (conftest.py, test_public_api.py), which one mypy
# run rejects as duplicates, so each gets a run of its own; everything else, including the
# top-level tests/, is in [tool.mypy] files. A distribution joins this list once
# `mypy packages/<dist>/tests` is clean.
TYPE_CHECKED_TESTS: tuple[str, ...] = (
    "core-utils",
    "bridge-config",
    "bridge-logging",
    "bridge-resiliency",
    "bridge-mimo",
    "bridge-train",
)


def _uv() -> str:
    # `uv run` exports the path of the running uv binary; fall back to PATH.
    return os.environ.get("UV", "uv")


def _sync(session: nox.Session, *args: str) -> None:
    """Install exactly what the lock says for ``args`` into this session's venv."""
    session.run_install(
        _uv(),
        "sync",
        "--locked",
        "--group",
        "dev",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
        external=True,
    )


@nox.session
@nox.parametrize("dist", [nox.param(name, id=name) for name in DISTRIBUTIONS])
def tests(session: nox.Session, dist: str) -> None:
    """Run one distribution's tests in a venv holding only it and its dependencies."""
    extras = [arg for extra in DISTRIBUTIONS[dist] for arg in ("--extra", extra)]
    _sync(session, "--package", dist, *extras)
    session.run("pytest", f"packages/{dist}/tests", *PYTEST_ARGS, *session.posargs)


@nox.session
def integration(session: nox.Session) -> None:
    """Cross-package and end-to-end tests (multi-process, CPU, gloo)."""
    _sync(session, "--all-packages")
    session.run("pytest", "tests", *PYTEST_ARGS, *session.posargs)


@nox.session(default=False)
def extended(session: nox.Session) -> None:
    """The long tiers left out of CI: every test marked ``extended``, in every directory."""
    _sync(session, "--all-packages")
    # bridge-resiliency's tests need the nvrx extra, which cannot share this venv.
    paths = ["tests", *(f"packages/{d}/tests" for d in DISTRIBUTIONS if d != "bridge-resiliency")]
    session.run("pytest", *paths, *PYTEST_ARGS, "-m", "extended", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (lint and format) and mypy over the whole workspace."""
    _sync(session, "--all-packages")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")
    for dist in TYPE_CHECKED_TESTS:
        session.run("mypy", f"packages/{dist}/tests")
    # Sibling pins and resolved versions agree with every declared requirement.
    session.run(_uv(), "pip", "check", "--python", session.virtualenv.location, external=True)
