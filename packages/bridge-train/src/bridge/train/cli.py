"""The ``bridge-train`` command (also ``python -m bridge.train``).

::

    bridge-train [--config RECIPE.yaml | --recipe NAME] [--metrics-file FILE]
                 [--print-config | --dry-run] [--version]
                 [--hang-timeout SECONDS [--hang-setup-timeout SECONDS]
                  [--hang-checkpoint-timeout SECONDS]] [--requeue-exit-code CODE]
                 [section.field=value ...]

With no arguments it trains the built-in ``tiny_gpt`` recipe. Launched bare it runs one
process; under ``torchrun`` or ``srun`` (SLURM, without torchrun) every rank runs it. Rank 0 prints what the overrides changed
against the recipe before training; the whole resolved config is saved as
``<checkpoint.save>/run_config.yaml`` and printed by ``--print-config``. ``--dry-run``
checks everything a launch checks, prints the parallel layout and exits.

``--help``, ``--version`` and errors found while reading the YAML and the overrides
(unknown section or field of a bridge.config section, wrong type, bad YAML, missing file,
duplicate key) answer without importing torch or megatron-core: nothing heavy is
imported before the config names a class that needs it.

Exit codes: 0 when training finished or stopped on purpose (exit signal, duration,
interval; ``--requeue-exit-code`` gives the latter a code of its own, for schedulers that
must requeue or restart the job); 2 for a configuration problem (printed as one line,
without a traceback, before anything is started; also a rendezvous whose ranks did not all
meet within ``dist.distributed_timeout_minutes``, printed by every rank); 1 when a training-loop callback raised (one line naming the
callback, hook and iteration) and for any other failure (with its traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["EXIT_CALLBACK_ERROR", "EXIT_CONFIG_ERROR", "EXIT_INTERRUPTED", "build_parser", "main"]

EXIT_CONFIG_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C
EXIT_CALLBACK_ERROR = 1

_USAGE = "bridge-train [--config FILE | --recipe NAME] [options] [section.field=value ...]"


# The launcher's view (torchrun's or srun's environment, bridge.train.engine.launch_env),
# read before any process group exists and without importing torch, which --help and
# configuration errors must not pay for. Once training runs, core_utils.distributed answers
# from the process group.
def _launcher_rank() -> int:
    from bridge.train.engine.launch_env import launch_environment

    try:
        return launch_environment().rank
    except ValueError:  # a broken launch environment: reported where it is read
        return 0


def _launcher_world_size() -> int:
    from bridge.train.engine.launch_env import launch_environment

    try:
        return launch_environment().world_size
    except ValueError:
        return 1


# One line per section for --help (the configuration reference has the fields).
_SECTION_SUMMARIES = {
    "rng": "random seeds",
    "rerun_state_machine": "result validation by re-running steps (CUDA)",
    "train": "batch sizes, length, evaluation, exit conditions, GC",
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
        "  bridge-train --dry-run model.num_layers=8      # check and show the plan, no training\n"
        "  bridge-train --config recipe.yaml checkpoint.save=runs/a\n"
        "  torchrun --nproc_per_node=2 -m bridge.train    # 2 data-parallel ranks\n"
        "  torchrun --nproc_per_node=2 -m bridge.train model.tensor_model_parallel_size=2\n"
        "  srun --ntasks-per-node=8 python -m bridge.train   # SLURM, no torchrun needed\n\n"
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
        "--requeue-exit-code",
        metavar="CODE",
        type=_exit_code,
        default=0,
        help="exit with CODE instead of 0 when the run stopped before its end on purpose "
        "(exit signal, train.exit_duration_in_mins, train.exit_interval) after saving, so a "
        "SLURM batch script requeues it or Kubernetes restarts it (docs/clusters.md)",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=_version_text(),
        help="show the versions of bridge-train, megatron-core and torch and exit",
    )
    show = parser.add_mutually_exclusive_group()
    show.add_argument(
        "--print-config",
        action="store_true",
        help="print the whole resolved config (recipe + overrides, validated) and exit",
    )
    show.add_argument(
        "--dry-run",
        action="store_true",
        help="check everything a launch checks (data files, checkpoint directories, layout "
        "for this world size), print the parallel layout and exit; no process group starts",
    )
    parser.add_argument(
        "--no-print-config",
        action="store_true",
        help="do not print what the overrides changed at start",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.field=value",
        help="dotted overrides applied to the recipe",
    )
    return parser


def _exit_code(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an exit code 0-255, got {text!r}") from None
    if not 0 <= value <= 255:
        raise argparse.ArgumentTypeError(f"expected an exit code 0-255, got {text!r}")
    return value


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
        recipe_cfg.validate(_launcher_world_size())

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
    cfg = load_config(path, args.overrides)  # first: its mistakes are the user's to see
    recipe_cfg = load_config(path) if args.overrides else None
    return cfg, path, recipe_cfg


def _version_text() -> str:
    """``bridge-train X (megatron-core Y, torch Z)`` from the installed metadata (no import)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    return f"bridge-train {of('bridge-train')} (megatron-core {of('megatron-core')}, torch {of('torch')})"


# Error types of sibling packages that mean "fix your input" (module, class name). They are
# looked up only when their module is already imported: an exception cannot be an instance
# of a class whose module was never loaded, and importing them would cost the start-up time.
_USER_ERROR_TYPES = (
    ("bridge.config", "ConfigError"),
    ("bridge.logging", "BackendNotInstalledError"),
    ("bridge.resiliency", "MissingExtraError"),
    ("bridge.resiliency", "ResiliencyError"),
    ("bridge.train.checkpointing", "CheckpointError"),
)


def _is_user_error(exc: BaseException) -> bool:
    for module_name, name in _USER_ERROR_TYPES:
        module = sys.modules.get(module_name)
        cls = getattr(module, name, None) if module is not None else None
        if isinstance(cls, type) and isinstance(exc, cls):
            return True
    return False


def _is_callback_error(exc: BaseException) -> bool:
    module = sys.modules.get("core_utils.callbacks")
    cls = getattr(module, "CallbackError", None) if module is not None else None
    return isinstance(cls, type) and isinstance(exc, cls)


def _report_notices(held: Any, cfg: Any) -> None:
    """Rank 0: one line about the held-back import notices, or all of them at DEBUG level.

    Other ranks print none of them. Unless the level is DEBUG, megatron-core's TE/Apex fallback notice,
    which it repeats when the model is built, is silenced on every rank.
    """
    from bridge.train._import_notices import silence_known_fallback_notices

    logger_cfg = getattr(cfg, "logger", None)
    level = getattr(logger_cfg, "logging_level", logging.INFO)
    if level > logging.DEBUG:
        silence_known_fallback_notices()
    if _launcher_rank() != 0 or not held.lines:
        return
    if level <= logging.DEBUG:
        for line in held.lines:
            print(f"[bridge-train] notice: {line}", file=sys.stderr, flush=True)
    else:
        print(f"[bridge-train] {held.summary()}", file=sys.stderr, flush=True)


def _print_overrides(path: Path, recipe_cfg: Any, cfg: Any) -> None:
    print(f"[bridge-train] recipe: {path}", flush=True)
    diff = _override_diff(recipe_cfg, cfg) if recipe_cfg is not None else []
    print("[bridge-train] overrides (recipe -> this run):", flush=True)
    print("\n".join(diff) if diff else "  (none)", flush=True)
    save = getattr(getattr(cfg, "checkpoint", None), "save", None)
    where = f"{save}/run_config.yaml" if save else "--print-config"
    print(f"[bridge-train] full resolved config: {where}", flush=True)


def _print_layout(cfg: Any, world: int) -> None:
    """The parallel layout and batch plan ``--dry-run`` reports."""
    model, train = cfg.model, cfg.train
    sizes = {
        "tensor": getattr(model, "tensor_model_parallel_size", 1),
        "pipeline": getattr(model, "pipeline_model_parallel_size", 1),
        "context": getattr(model, "context_parallel_size", 1),
        "data": cfg.data_parallel_size,
    }
    print(f"[bridge-train] dry run: world size {world}", flush=True)
    print(
        "[bridge-train] parallel layout: " + ", ".join(f"{k} {v}" for k, v in sizes.items()),
        flush=True,
    )
    mbs, gbs = train.micro_batch_size, train.global_batch_size
    micro = gbs // (mbs * cfg.data_parallel_size) if gbs and mbs else None
    print(
        f"[bridge-train] batches: micro {mbs} x {micro} micro-batches x data {sizes['data']} "
        f"= global {gbs}; train_iters {train.train_iters}",
        flush=True,
    )
    print(
        "[bridge-train] dry run: the config is valid for this launch; nothing was trained",
        flush=True,
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
    from bridge.train.engine.launch_env import adopt_launch_environment, launch_notice

    # srun's tasks become torch's variables before anything reads them; an environment that
    # cannot be a real launch is refused here, in one line.
    launch = adopt_launch_environment()
    from bridge.train.checks.launch import (
        check_output_file,
        shared_store_restart_notice,
    )

    for notice in (shared_store_restart_notice(os.environ), launch_notice()):
        if notice is not None and launch.rank == 0:
            print(f"[bridge-train] warning: {notice}", file=sys.stderr, flush=True)
    if args.metrics_file is not None:
        check_output_file(args.metrics_file, "--metrics-file")
    from bridge.train._import_notices import held_notices

    with held_notices() as held:
        cfg, path, recipe_cfg = _load(args)
        # The one pass of checks (what --dry-run promises): the sections' own rules, then
        # the trainer's rules about each section, for a GPT-style run or the mimo recipe.
        from bridge.train.checks.preflight import check_config_before_launch, run_kind

        check_config_before_launch(cfg)
        mimo = run_kind(cfg.model) == "mimo"
        # Imported here too: the import's notices (megatron-core's) are held like the rest.
        if mimo:
            from bridge.train.loop.pretrain_mimo import pretrain_mimo
        else:
            from bridge.train.loop.pretrain import pretrain
    if args.print_config:
        if _launcher_rank() == 0:
            # The text run_config.yaml holds: it loads back (--config) as this same run.
            from bridge.train.loop.run_config import run_config_text

            print(run_config_text(cfg), end="", flush=True)
        return 0
    _report_notices(held, cfg)
    if args.dry_run:
        if _launcher_rank() == 0:
            _print_overrides(path, recipe_cfg, cfg)
            if not mimo:
                _print_layout(cfg, _launcher_world_size())
        return 0
    if _launcher_rank() == 0 and not args.no_print_config:
        _print_overrides(path, recipe_cfg, cfg)
    if mimo:
        return pretrain_mimo(
            cfg, metrics_file=args.metrics_file, requeue_exit_code=args.requeue_exit_code
        )
    return pretrain(
        cfg,
        metrics_file=args.metrics_file,
        hang_timeout=hang_timeout,
        requeue_exit_code=args.requeue_exit_code,
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``bridge-train``: exits with the code of :func:`run`.

    Configuration problems are printed (by rank 0) as ``bridge-train: error: ...`` without a
    traceback and exit with code 2. Ctrl-C (SIGINT) and SIGTERM end the run with one line
    and exit codes 130 and 143 (128 + the signal number); further signals while the run
    closes are ignored, except a second Ctrl-C, which exits at once.
    """
    from bridge.train.checks.launch import Terminated, interrupt_handlers

    try:
        with interrupt_handlers():
            code = run(argv)
    except (KeyboardInterrupt, Terminated) as exc:
        signal_name = "SIGTERM" if isinstance(exc, Terminated) else "SIGINT (Ctrl-C)"
        if _launcher_rank() == 0:
            print(f"bridge-train: stopped by {signal_name}", file=sys.stderr, flush=True)
        sys.exit(143 if isinstance(exc, Terminated) else EXIT_INTERRUPTED)
    except Exception as exc:
        if _is_callback_error(exc):
            # The user's own code failed, not the trainer: say which callback, hook and
            # iteration, on every rank where it happened.
            prefix = f"[rank {_launcher_rank()}] " if _launcher_world_size() > 1 else ""
            print(f"bridge-train: error: {prefix}{exc}", file=sys.stderr, flush=True)
            sys.exit(EXIT_CALLBACK_ERROR)
        if not _is_user_error(exc):
            raise
        rendezvous = sys.modules.get("bridge.train.engine.launch_env")
        timeout_type = getattr(rendezvous, "RendezvousTimeout", None)
        if isinstance(timeout_type, type) and isinstance(exc, timeout_type):
            # Each rank saw its own part of a rendezvous that failed: every rank says it.
            print(f"bridge-train: error: {exc}", file=sys.stderr, flush=True)
        elif _launcher_rank() == 0:
            # The launch checks report the first problem of every section at once.
            for problem in getattr(exc, "problems", None) or (exc,):
                print(f"bridge-train: error: {problem}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG_ERROR)
    sys.exit(code)
