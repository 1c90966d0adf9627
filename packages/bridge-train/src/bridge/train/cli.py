"""The ``bridge-train`` command (also ``python -m bridge.train``).

::

    bridge-train [--config RECIPE.yaml | --recipe NAME] [--metrics-file FILE]
                 [--hang-timeout SECONDS [--hang-setup-timeout SECONDS]
                  [--hang-checkpoint-timeout SECONDS]] [section.field=value ...]

With no arguments it trains the built-in ``tiny_gpt`` recipe. Launched bare it runs one
process; under ``torchrun`` every rank runs it. The resolved config (after overrides and
validation) and what the overrides changed are printed by rank 0 before training; the
config is also saved as ``<checkpoint.save>/run_config.yaml``.

Exit codes: 0 when training finished or stopped on purpose (exit signal, duration,
interval); 2 for a configuration problem (printed as one line, without a traceback,
before anything is started); 1 for any other failure (with its traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["EXIT_CONFIG_ERROR", "build_parser", "main"]

EXIT_CONFIG_ERROR = 2

_USAGE = "bridge-train [--config FILE | --recipe NAME] [options] [section.field=value ...]"


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


# One line per section for --help (the configuration reference has the fields).
_SECTION_SUMMARIES = {
    "rng": "random seeds",
    "rerun_state_machine": "result validation by re-running steps (CUDA)",
    "train": "batch sizes, length, evaluation, exit conditions, GC, engine",
    "model": "model config (_target_: bridge.train.models.GPTModelProvider), parallel sizes",
    "optimizer": "optimizer (_target_: megatron.core.optimizer.OptimizerConfig)",
    "ddp": "data-parallel gradient reduction",
    "scheduler": "learning-rate and weight-decay schedule",
    "dataset": "training data (.bin/.idx blends, or mock data)",
    "logger": "console line, TensorBoard, W&B, timers, progress.txt",
    "tokenizer": "tokenizer (byte-level, Hugging Face directory, null)",
    "checkpoint": "save / load directories, intervals, async save",
    "dist": "torch.distributed backend (gloo on CPU, nccl on GPU) and timeout",
    "ft": "fault tolerance and simulated faults",
    "straggler": "per-rank step timing reports",
    "nvrx_straggler": "nvidia-resiliency-ext straggler detection (CUDA)",
    "profiling": "torch profiler / nsys between two steps",
    "peft": "parameter-efficient finetuning",
    "comm_overlap": "communication overlap settings",
    "mixed_precision": "mixed-precision recipe",
}


def _sections_help() -> str:
    from bridge.config import ConfigContainer, describe_fields

    lines = []
    for info in describe_fields(ConfigContainer):
        if not info.settable:
            continue
        summary = _SECTION_SUMMARIES.get(info.name) or info.doc.split(". ")[0].split("\n")[0]
        lines.append(f"  {info.name:<20} {summary}")
    return "\n".join(lines)


def _recipes_help() -> str:
    from bridge.train.recipes import DEFAULT_RECIPE, RECIPES

    width = max(len(name) for name in RECIPES)
    lines = []
    for recipe in RECIPES.values():
        marker = " (default)" if recipe.name == DEFAULT_RECIPE else ""
        summary = recipe.summary.replace(" (the default)", "")
        wrapped = textwrap.wrap(summary + marker, width=72 - width)
        lines.append(f"  {recipe.name:<{width}}  {wrapped[0]}")
        lines += [f"  {'':<{width}}  {more}" for more in wrapped[1:]]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``bridge-train`` (its help lists recipes and config sections)."""
    epilog = (
        "recipes (--recipe NAME):\n"
        f"{_recipes_help()}\n\n"
        "config sections (override fields as section.field=value):\n"
        f"{_sections_help()}\n\n"
        "examples:\n"
        "  bridge-train                                   # tiny GPT on mock data, ~1 min on CPU\n"
        "  bridge-train train.train_iters=300 optimizer.lr=1e-3\n"
        "  bridge-train --config recipe.yaml checkpoint.save=runs/a\n"
        "  torchrun --nproc_per_node=2 -m bridge.train    # 2 data-parallel ranks\n"
        "  torchrun --nproc_per_node=2 -m bridge.train model.tensor_model_parallel_size=2\n\n"
        "Overrides follow OmegaConf's grammar (numbers, true/false, null, [lists], "
        "${interpolations}); see docs/yaml-and-overrides.md and docs/training.md."
    )
    parser = argparse.ArgumentParser(
        prog="bridge-train",
        usage=_USAGE,
        description="Train a megatron-core model from a YAML recipe plus dotted overrides.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", metavar="FILE", help="YAML recipe to train")
    source.add_argument(
        "--recipe", metavar="NAME", help="built-in recipe to train (default: tiny_gpt)"
    )
    parser.add_argument(
        "--metrics-file",
        metavar="FILE",
        help="also write every logged metric as JSON lines to FILE (last rank)",
    )
    parser.add_argument(
        "--hang-timeout",
        metavar="SECONDS",
        type=_positive_seconds,
        help="kill a rank whose training step takes longer than this (built-in watchdog, "
        "for torchrun --max-restarts)",
    )
    parser.add_argument(
        "--hang-setup-timeout",
        metavar="SECONDS",
        type=_positive_seconds,
        help="with --hang-timeout: limit for setup (model build, checkpoint load) and the "
        "first step (default: unlimited)",
    )
    parser.add_argument(
        "--hang-checkpoint-timeout",
        metavar="SECONDS",
        type=_positive_seconds,
        help="with --hang-timeout: limit for one checkpoint save (default: unlimited)",
    )
    parser.add_argument(
        "--no-print-config",
        action="store_true",
        help="do not print the resolved config at start",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.field=value",
        help="dotted overrides applied to the recipe",
    )
    return parser


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _hang_timeouts(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Any:
    """``--hang-*`` options as what ``pretrain(hang_timeout=...)`` takes (None: no watchdog)."""
    phases = {"setup": args.hang_setup_timeout, "checkpointing": args.hang_checkpoint_timeout}
    if args.hang_timeout is None:
        options = {"setup": "--hang-setup-timeout", "checkpointing": "--hang-checkpoint-timeout"}
        given = [options[phase] for phase, value in phases.items() if value is not None]
        if given:
            parser.error(f"{', '.join(given)} needs --hang-timeout (the step limit)")
        return None
    if not any(phases.values()):
        return args.hang_timeout
    from bridge.resiliency import WatchdogTimeouts

    return WatchdogTimeouts(step=args.hang_timeout, **phases)


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    if isinstance(data, dict):
        for key, value in data.items():
            flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    else:
        flat[prefix] = data
    return flat


def _override_diff(recipe_cfg: Any, run_cfg: Any) -> list[str]:
    """``path: recipe value -> run value`` for every value the overrides changed.

    The recipe alone is validated like the run (when it validates), so values derived by
    ``validate()`` differ only where the overrides changed what they derive from.
    """
    import yaml

    from bridge.config import ConfigError

    with contextlib.suppress(ConfigError):  # a recipe that needs its overrides to validate
        recipe_cfg.validate(_world_size())

    before = _flatten(yaml.safe_load(recipe_cfg.format_yaml()))
    after = _flatten(yaml.safe_load(run_cfg.format_yaml()))
    lines = []
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key, "<unset>"), after.get(key, "<unset>")
        if old != new:
            lines.append(f"  {key}: {old!r} -> {new!r}")
    return lines


def _load(args: argparse.Namespace) -> tuple[Any, Path, Any]:
    """``(config with overrides, recipe file, config of the recipe alone)``."""
    from bridge.config import load_config
    from bridge.train.recipes import DEFAULT_RECIPE, recipe_path

    if args.config is not None:
        path = Path(args.config)
    else:
        try:
            path = recipe_path(args.recipe or DEFAULT_RECIPE)
        except KeyError as exc:
            from bridge.config import ConfigError

            raise ConfigError("--recipe", str(exc.args[0])) from None
    recipe_cfg = load_config(path) if args.overrides else None
    cfg = load_config(path, args.overrides)
    return cfg, path, recipe_cfg


def _is_mimo(cfg: Any) -> bool:
    from bridge.train.recipes.mimo import MimoModelConfig

    return isinstance(cfg.model, MimoModelConfig)


def _print_config(cfg: Any, path: Path, recipe_cfg: Any) -> None:
    print(f"[bridge-train] recipe: {path}", flush=True)
    print("[bridge-train] resolved config:", flush=True)
    print(cfg.format_yaml(), end="", flush=True)
    if recipe_cfg is not None:
        diff = _override_diff(recipe_cfg, cfg)
        print("[bridge-train] overrides (recipe -> this run):", flush=True)
        print("\n".join(diff) if diff else "  (none)", flush=True)
    else:
        print("[bridge-train] overrides (recipe -> this run): (none)", flush=True)


def _user_errors() -> tuple[type[BaseException], ...]:
    from bridge.config import ConfigError
    from bridge.logging import BackendNotInstalledError
    from bridge.resiliency import MissingExtraError, ResiliencyError
    from bridge.train.checkpointing import CheckpointError

    return (
        ConfigError,
        BackendNotInstalledError,
        MissingExtraError,
        ResiliencyError,
        CheckpointError,
    )


def run(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, train, and return the exit code (see the module docstring).

    Raises:
        bridge.config.ConfigError: (and the other configuration errors) for :func:`main`
            to report.
    """
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)
    hang_timeout = _hang_timeouts(args, parser)
    cfg, path, recipe_cfg = _load(args)
    if _is_mimo(cfg):
        from bridge.train.recipes.mimo import check_mimo_config, pretrain_mimo

        check_mimo_config(cfg)
        if _rank() == 0 and not args.no_print_config:
            _print_config(cfg, path, recipe_cfg)
        return pretrain_mimo(cfg, metrics_file=args.metrics_file)

    from bridge.train.training.preflight import check_config_before_launch
    from bridge.train.training.pretrain import pretrain

    check_config_before_launch(cfg)
    if _rank() == 0 and not args.no_print_config:
        _print_config(cfg, path, recipe_cfg)
    return pretrain(cfg, metrics_file=args.metrics_file, hang_timeout=hang_timeout)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``bridge-train``: exits with the code of :func:`run`.

    Configuration problems are printed (by rank 0) as ``bridge-train: error: ...`` without a
    traceback and exit with code 2.
    """
    try:
        code = run(argv)
    except _user_errors() as exc:
        if _rank() == 0:
            print(f"bridge-train: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG_ERROR)
    sys.exit(code)
