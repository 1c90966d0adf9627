"""The ``bridge-train`` command (also ``python -m bridge.train``).

::

    bridge-train [RECIPE.yaml | --config RECIPE.yaml | --recipe NAME] [--metrics-file FILE]
                 [--print-config | --dry-run] [--version] [--eval-only [--eval-data FILE]]
                 [--hang-timeout SECONDS [--hang-setup-timeout SECONDS]
                  [--hang-checkpoint-timeout SECONDS]] [--requeue-exit-code CODE]
                 [section.field=value ...]

With no arguments it trains the built-in ``tiny_gpt`` recipe. Launched bare it runs one
process; under ``torchrun`` or ``srun`` (SLURM, without torchrun) every rank runs it. Rank 0 prints what the overrides changed
against the recipe before training; the whole resolved config is saved as
``<checkpoint.save>/run_config.yaml`` and printed by ``--print-config``. ``--dry-run``
checks everything a launch checks, prints the parallel layout and exits.

``--eval-only`` trains nothing: it loads ``checkpoint.load`` and reports the validation and
test loss and perplexity (of the run's datasets, or of ``--eval-data FILE``); without
``--config`` / ``--recipe`` the checkpoint's own ``run_config.yaml`` is the config (see
:mod:`bridge.train.generate.evaluation`).

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
import json
import logging
import os
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import yaml

from bridge.config import (
    ConfigContainer,
    ConfigDiff,
    ConfigError,
    DistributedInitConfig,
    ModelConfigProtocol,
    TrainingConfig,
    describe_fields,
    flatten_config,
    load_config,
    parse_overrides,
)
from bridge.config.notices import held_notices, print_held_notices, silence_known_fallback_notices
from bridge.train.checks.launch import (
    Terminated,
    check_output_file,
    interrupt_handlers,
    shared_store_restart_notice,
)
from bridge.train.recipes import DEFAULT_RECIPE, RECIPES, recipe_path

__all__ = [
    "EXIT_CALLBACK_ERROR",
    "EXIT_CONFIG_ERROR",
    "EXIT_INTERRUPTED",
    "USER_ERROR_TYPES",
    "build_parser",
    "main",
    "raised_as",
]

EXIT_CONFIG_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C
EXIT_CALLBACK_ERROR = 1

_USAGE = (
    "bridge-train [FILE.yaml | --config FILE | --recipe NAME] [options] [section.field=value ...]"
)


# The launcher's view (torchrun's or srun's environment, bridge.train.engine.launch_env),
# read before any process group exists and without importing torch, which --help and
# configuration errors must not pay for. Once training runs, core_utils.distributed answers
# from the process group.
def _launcher() -> Any:
    from bridge.train.engine.launch_env import LaunchEnvironment, launch_environment

    try:
        return launch_environment()
    except ValueError:  # a broken launch environment: reported where it is read
        return LaunchEnvironment("single", 0, 1, 0)


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
    "samples": "sample completions generated at evaluation time",
    "comm_overlap": "communication overlap settings",
    "mixed_precision": "mixed-precision recipe",
}


def _sections_help() -> str:
    lines = []
    for info in describe_fields(ConfigContainer):
        if not info.settable:
            continue
        summary = _SECTION_SUMMARIES.get(info.name) or info.doc.split(". ")[0].split("\n")[0]
        lines.append(f"  {info.name:<20} {summary}")
    return "\n".join(lines)


def _recipes_help() -> str:
    width = max(len(name) for name in RECIPES)
    lines = []
    for name, summary in RECIPES.items():
        marker = " (default)" if name == DEFAULT_RECIPE else ""
        wrapped = textwrap.wrap(summary + marker, width=72 - width)
        lines.append(f"  {name:<{width}}  {wrapped[0]}")
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
        "  bridge-train recipe.yaml checkpoint.save=runs/a  # the same\n"
        "  bridge-train --eval-only checkpoint.load=runs/a     # validation/test loss, no training\n"
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
    source.add_argument(
        "--config",
        metavar="FILE",
        help="YAML recipe to train (a first argument ending in .yaml or .yml is taken as it)",
    )
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
        "--eval-only",
        action="store_true",
        help="train nothing: load checkpoint.load and report its validation and test loss and "
        "perplexity (config: the checkpoint's run_config.yaml unless --config/--recipe)",
    )
    parser.add_argument(
        "--eval-data",
        metavar="FILE",
        help="with --eval-only: evaluate this file instead of the run's datasets (an SFT "
        "JSONL, {'text': ...} JSON lines, or a text file)",
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


def _config_from_first_argument(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``bridge-train recipe.yaml [overrides]``: a first argument that is a YAML file, not an
    override, is the recipe (as ``--config``)."""
    if not args.overrides:
        return
    first = args.overrides[0]
    if "=" in first or not first.endswith((".yaml", ".yml")):
        return
    if args.config is not None or args.recipe is not None:
        given = "--config" if args.config is not None else "--recipe"
        parser.error(f"{first} and {given} both name a recipe; give one")
    args.config = first
    args.overrides = args.overrides[1:]


def _checked(
    convert: Callable[[str], Any], what: str, valid: Callable[[Any], bool], bound: str = ""
) -> Callable[[str], Any]:
    """An argparse ``type``: ``convert``, refused in one line unless ``valid``."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not valid(value):
            raise argparse.ArgumentTypeError(f"expected {what}{bound}, got {text!r}")
        return value

    return parse


_exit_code = _checked(int, "an exit code 0-255", lambda value: 0 <= value <= 255)
_positive_seconds = _checked(float, "a number of seconds", lambda value: value > 0, " > 0")


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


def _overrides_of(
    before: dict[str, Any], after: dict[str, Any], run_diffs: Sequence[ConfigDiff]
) -> list[str]:
    """``path: recipe value -> run value`` for every value the overrides changed, from the
    recipe's and the run's values by dotted path (the recipe validated like the run when it
    validates) and the run's ``diff_from_defaults()``. A section whose class the overrides
    replaced (``dataset._target_=...``) is one line for the class and the old class's fields
    left out, then the new section's fields that differ from the recipe's or, where the
    recipe had no such field, from the new class's defaults.
    """
    replaced = sorted(
        key.removesuffix("._target_")
        for key in set(before) & set(after)
        if key.endswith("._target_") and before[key] != after[key]
    )
    lines = []
    for key in sorted(set(before) | set(after)):
        section = next((r for r in replaced if key.startswith(r + ".")), None)
        old, new = before.get(key, "<unset>"), after.get(key, "<unset>")
        if section is not None and key == f"{section}._target_":
            left_out = sum(1 for k in before if k.startswith(section + ".") and k not in after)
            dropped = f" ({left_out} fields of the recipe's class left out)"
            lines.append(f"  {key}: {old!r} -> {new!r}{dropped if left_out else ''}")
        elif section is not None and (key not in after or key not in before):
            # Listed with the class change, or below where it differs from the new class's
            # default.
            continue
        elif old != new:
            lines.append(f"  {key}: {old!r} -> {new!r}")
    defaults = {diff.path: diff.default for diff in run_diffs}
    for section in replaced:
        for key, default in defaults.items():
            field_name = key.removeprefix(section + ".")
            if field_name != key and "." not in field_name and key not in before and key in after:
                lines.append(f"  {key}: <default {default!r}> -> {after[key]!r}")
    return lines


def _load(args: argparse.Namespace) -> tuple[Any, Path, Any]:
    """``(config with overrides, recipe file, config of the recipe alone)``."""
    overrides = dict(parse_overrides(args.overrides))
    load = overrides.get("checkpoint.load")  # what --eval-only evaluates
    if args.config is not None:
        path = Path(args.config)
    elif args.eval_only and args.recipe is None and load:  # the checkpoint's own config
        from bridge.train.checkpointing import CheckpointError
        from bridge.train.checkpointing.layout import RUN_CONFIG_FILENAME, locate_checkpoint

        try:
            _, iteration_dir = locate_checkpoint(str(load))
        except CheckpointError as exc:
            raise ConfigError("checkpoint.load", str(exc)) from None
        path = iteration_dir / RUN_CONFIG_FILENAME
        if not path.is_file():
            raise ConfigError(
                "checkpoint.load",
                f"{iteration_dir} has no {RUN_CONFIG_FILENAME}; give the run's recipe with --config",
            )
    else:
        try:
            path = recipe_path(args.recipe or DEFAULT_RECIPE)
        except KeyError as exc:
            raise ConfigError("--recipe", str(exc.args[0])) from None
    cfg = load_config(path, args.overrides)  # first: its mistakes are the user's to see
    recipe_cfg = load_config(path) if args.overrides else None
    # After the config's own errors, which are reported without importing megatron.
    from bridge.train.checkpointing.layout import RUN_CONFIG_FILENAME

    if path.name == RUN_CONFIG_FILENAME and "dist.local_rank" not in overrides:
        # A run_config.yaml saved before saved configs left dist.local_rank out holds the
        # saving process's (rank 0's); it describes that process, not this one.
        for loaded in (cfg, recipe_cfg):
            if loaded is not None and loaded.dist is not None:
                loaded.dist.local_rank = DistributedInitConfig().local_rank
    return cfg, path, recipe_cfg


def _version_text() -> str:
    """``bridge-train X (megatron-core Y, torch Z)`` from the installed metadata (no import)."""

    def of(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    return f"bridge-train {of('bridge-train')} (megatron-core {of('megatron-core')}, torch {of('torch')})"


# Error types of sibling packages that mean "fix your input" (module, class name).
USER_ERROR_TYPES = (
    ("bridge.config", "ConfigError"),
    ("bridge.logging", "BackendNotInstalledError"),
    ("bridge.resiliency", "MissingExtraError"),
    ("bridge.resiliency", "ResiliencyError"),
    ("bridge.train.checkpointing", "CheckpointError"),
)


def raised_as(exc: BaseException, types: Sequence[tuple[str, str]]) -> bool:
    """Whether ``exc`` is an instance of one of ``types`` (module, class name).

    A class is looked up only when its module is already imported: an exception cannot be
    an instance of a class whose module was never loaded, and importing them would cost the
    start-up time.
    """
    classes = (getattr(sys.modules.get(module_name), name, None) for module_name, name in types)
    return any(isinstance(cls, type) and isinstance(exc, cls) for cls in classes)


def _report_notices(held: Any, level: int, rank: int) -> None:
    """Rank 0: one line about the held-back import notices, or all of them at DEBUG level.

    Other ranks print none of them. Unless the level is DEBUG, the notices megatron-core
    repeats when the model is built (TE/Apex fallback, experimental MIMO classes, CUDA
    advice on a machine without CUDA) are silenced on every rank. ``level`` is the run's
    ``logger.logging_level``.
    """
    if level > logging.DEBUG:
        torch = sys.modules.get("torch")  # imported with the config's classes, if at all
        silence_known_fallback_notices(cuda=torch is not None and torch.cuda.is_available())
    if rank != 0:
        return
    print_held_notices(
        held,
        "[bridge-train] ",
        verbose=level <= logging.DEBUG,
        how_to_see="logger.logging_level=10 prints them",
    )


def _print_overrides(
    path: Path, diff: list[str], save: str | None, *, dry_run: bool = False
) -> None:
    """The recipe, what the overrides changed in it (``diff``) and where the run's whole
    config is saved (``save``: its ``checkpoint.save``)."""
    if not save:
        where = "--print-config"
    elif dry_run:  # nothing is written by a dry run
        where = f"--print-config (a launch saves it as {save}/run_config.yaml)"
    else:
        where = f"{save}/run_config.yaml"
    print(
        f"[bridge-train] recipe: {path}\n[bridge-train] overrides (recipe -> this run):\n"
        + ("\n".join(diff) if diff else "  (none)")
        + f"\n[bridge-train] full resolved config: {where}",
        flush=True,
    )


def _print_layout(
    model: ModelConfigProtocol,
    train: TrainingConfig,
    data_parallel_size: int | None,
    world: int,
) -> None:
    """The parallel layout and batch plan ``--dry-run`` reports."""
    sizes = {
        "tensor": getattr(model, "tensor_model_parallel_size", 1),
        "pipeline": getattr(model, "pipeline_model_parallel_size", 1),
        "context": getattr(model, "context_parallel_size", 1),
        "data": data_parallel_size,
    }
    mbs, gbs = train.micro_batch_size, train.global_batch_size
    micro = gbs // (mbs * data_parallel_size) if gbs and mbs and data_parallel_size else None
    layout = ", ".join(f"{k} {v}" for k, v in sizes.items())
    print(
        f"[bridge-train] dry run: world size {world}\n"
        f"[bridge-train] parallel layout: {layout}\n"
        f"[bridge-train] batches: micro {mbs} x {micro} micro-batches x data {sizes['data']} "
        f"= global {gbs}; train_iters {train.train_iters}\n"
        "[bridge-train] dry run: the config is valid for this launch; nothing was trained",
        flush=True,
    )


def run(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, train, and return the exit code (see the module docstring).

    Raises:
        bridge.config.ConfigError: (and the other configuration errors) for :func:`main`
            to report.
    """
    with contextlib.ExitStack() as launch_scope:
        return _run(argv, launch_scope)


def _run(argv: Sequence[str] | None, launch_scope: contextlib.ExitStack) -> int:
    """:func:`run`; what enters ``launch_scope`` lasts until the launch ends."""
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)
    _config_from_first_argument(args, parser)
    hang_timeout = _hang_timeouts(args, parser)
    from bridge.train.engine.launch_env import adopt_launch_environment, launch_notice

    # srun's tasks become torch's variables before anything reads them; an environment that
    # cannot be a real launch is refused here, in one line.
    launch = adopt_launch_environment()

    for notice in (shared_store_restart_notice(os.environ), launch_notice()):
        if notice is not None and launch.rank == 0:
            print(f"[bridge-train] warning: {notice}", file=sys.stderr, flush=True)
    if args.metrics_file is not None:
        check_output_file(args.metrics_file, "--metrics-file")

    if args.eval_data is not None and not args.eval_only:
        parser.error("--eval-data needs --eval-only")
    with held_notices() as held:
        cfg, path, recipe_cfg = _load(args)
        eval_plan = None
        if args.eval_only:
            from bridge.train.generate.evaluation import prepare_eval_only

            eval_plan = prepare_eval_only(cfg, eval_data=args.eval_data)
        # The one pass of checks (what --dry-run promises): the sections' own rules, then
        # the trainer's rules about each section, for a GPT-style run or the mimo recipe.
        from bridge.train.checkpointing.layout import one_lookup_per_launch
        from bridge.train.checks.preflight import check_config_before_launch, run_kind

        # The checks, the dry run's notices and the load resume the same checkpoint: the
        # save directory is looked up once (and a tracker fallback reported once).
        launch_scope.enter_context(one_lookup_per_launch())
        check_config_before_launch(cfg)
        mimo = run_kind(cfg.model) == "mimo"
        # Imported here too: the import's notices (megatron-core's) are held like the rest.
        if mimo:
            from bridge.train.loop.pretrain_mimo import pretrain_mimo
        else:
            from bridge.train.loop.pretrain import pretrain
    if args.print_config:
        if launch.rank == 0:
            # The text run_config.yaml holds: it loads back (--config) as this same run.
            print(cfg.to_yaml_text(), end="", flush=True)
        return 0
    _report_notices(held, cfg.logger.logging_level if cfg.logger else logging.INFO, launch.rank)
    save = cfg.checkpoint.save if cfg.checkpoint else None
    overrides: list[str] = []  # what the command-line overrides changed in the recipe
    if recipe_cfg is not None and launch.rank == 0 and (args.dry_run or not args.no_print_config):
        with contextlib.suppress(ConfigError):  # a recipe that needs its overrides to validate
            recipe_cfg.validate(launch.world_size)
        overrides = _overrides_of(
            flatten_config(yaml.safe_load(recipe_cfg.format_yaml())),
            flatten_config(yaml.safe_load(cfg.format_yaml())),
            cfg.diff_from_defaults(),
        )
    if args.dry_run:
        if launch.rank == 0:
            _print_overrides(path, overrides, save, dry_run=True)
            if not mimo:
                from bridge.train.checks.resume import IDENTITY_SECTIONS, run_plan_notices

                identity = {name: getattr(cfg, name) for name in IDENTITY_SECTIONS}
                for notice in run_plan_notices(cfg.checkpoint, cfg.train, identity):
                    print(f"[bridge-train] {notice}", flush=True)
                assert cfg.train is not None  # validated
                _print_layout(cfg.model, cfg.train, cfg.data_parallel_size, launch.world_size)
        return 0
    if launch.rank == 0 and not args.no_print_config:
        _print_overrides(path, overrides, save)
    if mimo:
        return pretrain_mimo(
            cfg, metrics_file=args.metrics_file, requeue_exit_code=args.requeue_exit_code
        )
    if eval_plan is not None:
        from bridge.train.generate.evaluation import evaluate_checkpoint

        evaluate_checkpoint(cfg, eval_plan, metrics_file=args.metrics_file)
        return 0
    return pretrain(
        cfg,
        metrics_file=args.metrics_file,
        hang_timeout=hang_timeout,
        requeue_exit_code=args.requeue_exit_code,
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``bridge-train``: exits with the code of :func:`run`.

    Configuration problems are reported as ``bridge-train: error: ...`` without a traceback
    and exit with code 2: printed by rank 0, or, under torchrun, written to torchrun's error
    file by every rank and shown once in torchrun's closing summary (see
    :func:`_report_config_error`). Ctrl-C (SIGINT) and SIGTERM end the run with one line
    and exit codes 130 and 143 (128 + the signal number); further signals while the run
    closes are ignored, except a second Ctrl-C, which exits at once.
    """
    try:
        with interrupt_handlers():
            code = run(argv)
    except (KeyboardInterrupt, Terminated) as exc:
        signal_name = "SIGTERM" if isinstance(exc, Terminated) else "SIGINT (Ctrl-C)"
        if _launcher().rank == 0:
            print(f"bridge-train: stopped by {signal_name}", file=sys.stderr, flush=True)
        sys.exit(143 if isinstance(exc, Terminated) else EXIT_INTERRUPTED)
    except Exception as exc:
        if raised_as(exc, [("core_utils.callbacks", "CallbackError")]):
            # The user's own code failed, not the trainer: say which callback, hook and
            # iteration, on every rank where it happened.
            prefix = f"[rank {_launcher().rank}] " if _launcher().world_size > 1 else ""
            print(f"bridge-train: error: {prefix}{exc}", file=sys.stderr, flush=True)
            sys.exit(EXIT_CALLBACK_ERROR)
        if not raised_as(exc, USER_ERROR_TYPES):
            raise
        if raised_as(exc, [("bridge.train.engine.launch_env", "RendezvousTimeout")]):
            # Each rank saw its own part of a rendezvous that failed: every rank says it.
            print(f"bridge-train: error: {exc}", file=sys.stderr, flush=True)
        else:
            # The launch checks report the first problem of every section at once.
            problems = getattr(exc, "problems", None) or (exc,)
            _report_config_error("\n".join(f"bridge-train: error: {p}" for p in problems))
        sys.exit(EXIT_CONFIG_ERROR)
    sys.exit(code)


def _report_config_error(line: str) -> None:
    """Show a configuration error once, whichever rank finds it first.

    Under torchrun no rank prints it: the first rank to fail makes torchrun stop the others
    (which may not have printed yet). The first rank of the node to find it writes it to
    its ``TORCHELASTIC_ERROR_FILE``, and torchrun's closing summary shows that file as its
    "Root Cause" (``traceback : bridge-train: error: ...``), the last lines of the launch;
    the ranks that find it too write a line pointing there (torchrun lists every failed
    rank's error file, so each writing the message showed it once per rank). Without
    torchrun's error file (one process, or another launcher), rank 0 prints it.
    """
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        # torchrun gives each local rank <attempt dir>/<local rank>/error.json; the first rank
        # to create a marker in the attempt directory (shared by the node's ranks, new for
        # each restart) is first. Where it cannot be made, every rank writes the message.
        attempt_dir = os.path.dirname(os.path.dirname(os.path.abspath(error_file)))
        marker = os.path.join(attempt_dir, "bridge-train-config-error")
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            first = True
        except FileExistsError:
            first = False
        except OSError:
            first = True
        # torchrun takes the failure with the earliest whole-second timestamp as the root
        # cause (and times a rank it stopped itself when it collects it): dated a second
        # earlier, the first failure stays the root cause when the failures fall in the same
        # second (ties go to the lowest rank); the others are dated a second later.
        shown = line if first else _SEE_ROOT_CAUSE
        stamp = str(int(time.time()) + (-1 if first else 1))
        info = {"py_callstack": shown, "timestamp": stamp}
        try:
            with open(error_file, "w", encoding="utf-8") as handle:
                json.dump({"message": {"message": shown, "extraInfo": info}}, handle)
            return
        except OSError:
            pass  # printed below instead
    if _launcher().rank == 0:
        print(line, file=sys.stderr, flush=True)


_SEE_ROOT_CAUSE = (
    "bridge-train: stopped by a configuration error too; the first rank's is shown under "
    "Root Cause below"
)
