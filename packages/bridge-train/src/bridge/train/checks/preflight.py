"""The one pass of checks before any process group, model or dataset exists.

:func:`check_config_before_launch` turns every problem a user can fix in the config into a
:class:`bridge.config.ConfigError` naming the field and the fix, in one ordered pass:

1. the sections' own rules (bridge-config): ``ConfigContainer.validate(world_size)``, which
   also fills the derived values (for the ``mimo`` recipe, whose modules have their own
   layouts: that its required sections are there);
2. the trainer's rules about each section (:data:`bridge.train.checks.registry.REGISTRY`,
   section by section in :data:`~bridge.train.checks.registry.SECTIONS` order): what a
   section accepts but the trainer cannot honour, or not on this machine (engine and
   parallel layout, data and tokenizer files, checkpoint and output directories, features
   that need CUDA, settings the ``mimo`` recipe does not implement).

Each section's rules stop at its first problem; the pass goes on with the next section, so
one launch reports one problem per section. ``pretrain``, ``pretrain_mimo`` and the
``bridge-train`` command (also with ``--dry-run``) run exactly this pass; the command prints
every problem without a traceback and exits with code 2.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from bridge.config import ConfigContainer, ConfigError, ModelConfigProtocol
from bridge.train.checks import mimo
from bridge.train.checks.registry import REGISTRY, SECTIONS, RunKind
from bridge.train.models.mimo import MimoModelConfig
from core_utils.distributed import global_world_size

__all__ = ["ConfigProblems", "check_config_before_launch", "check_section", "run_kind"]


class ConfigProblems(ConfigError):
    """Several sections have a problem: the first one's error, carrying all of them.

    ``str()`` is the first problem's one line (what a caller that reports one error shows);
    :attr:`problems` holds one error per section, in the pass's order.

    Attributes:
        problems: The first problem of every section that has one.
    """

    def __init__(self, problems: Sequence[ConfigError]) -> None:
        first = problems[0]
        super().__init__(first.location, first.detail)
        self.problems = tuple(problems)


def run_kind(model: ModelConfigProtocol | None) -> RunKind:
    """The kind of run a ``model`` section describes: the ``mimo`` recipe or a GPT-style
    run."""
    return "mimo" if isinstance(model, MimoModelConfig) else "gpt"


def _facts(world_size: int | None, cuda_available: bool | None) -> dict[str, Any]:
    world = world_size if world_size is not None else global_world_size(launcher_fallback=True)
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    return {"world_size": world, "cuda_available": cuda}


def _first_problem(values: Mapping[str, Any], section: str, kind: RunKind) -> ConfigError | None:
    for rule in REGISTRY.get(section, ()):
        if kind not in rule.runs:
            continue
        try:
            rule(values)
        except ConfigError as exc:
            return exc
    return None


def check_section(
    sections: Mapping[str, Any],
    section: str,
    world_size: int | None = None,
    *,
    cuda_available: bool | None = None,
) -> None:
    """Run the trainer's rules about one section (of a config that passed ``validate()``).

    Args:
        sections: The config's sections by name (at least those the section's rules read,
            and ``model``), e.g. ``vars(cfg)``.
        section: A key of :data:`~bridge.train.checks.registry.REGISTRY`.
        world_size: Number of ranks (default: the process group's, else ``$WORLD_SIZE``,
            else 1).
        cuda_available: Override CUDA detection.

    Raises:
        ConfigError: The section's first problem.
        KeyError: ``section`` has no rules.
    """
    if section not in REGISTRY:
        raise KeyError(f"no rules for section {section!r}; sections: {', '.join(SECTIONS)}")
    values = {**sections, **_facts(world_size, cuda_available)}
    problem = _first_problem(values, section, run_kind(sections["model"]))
    if problem is not None:
        raise problem


def check_config_before_launch(
    cfg: ConfigContainer,
    world_size: int | None = None,
    *,
    cuda_available: bool | None = None,
) -> None:
    """Check ``cfg`` for a training launch, before anything distributed is built.

    See the module docstring for the pass. ``validate()`` completes the config in place.

    Args:
        cfg: The run's configuration.
        world_size: Number of ranks (default: the initialised process group's, else
            ``$WORLD_SIZE``, else 1).
        cuda_available: Override CUDA detection (default ``torch.cuda.is_available()``).

    Raises:
        ConfigError: The sections' own rules failed (the first problem), or
            :class:`ConfigProblems`: the first problem of every section whose trainer rules
            failed.
    """
    facts = _facts(world_size, cuda_available)
    kind = run_kind(cfg.model)
    if kind == "gpt":
        cfg.validate(facts["world_size"])
    else:
        mimo.check_required_sections(vars(cfg))
    # Built once, after validate() completed the sections: each rule gets what it reads.
    values = {**vars(cfg), **facts}
    problems = [
        problem
        for section in SECTIONS
        if (problem := _first_problem(values, section, kind)) is not None
    ]
    if problems:
        raise ConfigProblems(problems)
