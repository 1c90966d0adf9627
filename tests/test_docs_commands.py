"""Every command README.md, docs/*.md and examples/README.md show works as written.

**Which commands.** Every line of a fenced ``bash`` / ``sh`` / ``shell`` / ``console``
block (``\\`` continuations joined, comments dropped), the lines of an untagged block that
start with ``uv run`` or ``torchrun``, and every inline code span that starts with ``uv run``, ``torchrun``, ``examples/`` or a console script of the workspace
(``bridge-train``, ``bridge-convert``, ... as the ``[project.scripts]`` tables declare
them) followed by an argument; a bare name (```bridge-train``` in a sentence) names the
command and is not run. Pages are found by glob, so a new page under ``docs/`` is read
without changing this file.

**How each is classified.** A command matching a pattern of :data:`NOT_RUN` is not run;
the entry says why (a GPU, a cluster, the network, the test suite itself, a placeholder).
Every other command runs. A new page's commands therefore run in the extended tier as
soon as the page exists; one that cannot run here fails until its pattern and reason are
added to :data:`NOT_RUN` (and an entry that no longer matches any command fails too, so
the table cannot go stale).

**Default tier (CI), seconds.** Every command is found as a shell would find it for a
user who has not activated the virtual environment: ``uv run X`` finds the workspace's
console scripts, ``python`` and ``torchrun``; a bare ``bridge-train``, ``python`` or
``torchrun`` is "command not found" and fails. Every ``bridge-train`` / ``-m
bridge.train`` command is parsed by the command's own parser and, when its recipe exists
before any command ran, loaded with its overrides and validated for its world size;
``--help``, ``--version`` and ``--print-config`` run in-process; the arguments of
``bridge-preprocess-data`` and ``bridge-convert`` are parsed by theirs.

**Extended tier (``uv run nox -s extended``), about an hour on 2 cores.** Each page's
commands run for real, in order, in a temporary directory holding a copy of ``examples/``
and ``benchmarks/`` (``/tmp/`` in a command is that directory's ``tmp/``), through bash,
with ``uv run`` meaning "with the project's virtual environment first on ``PATH``" (what
it does in a synced clone) and the environment otherwise not activated. Training
commands are shortened: every iteration count and interval among their overrides is
divided by 10 (rounded up), and one without ``train.train_iters`` gets its recipe's
divided by 10; a checkpoint directory a command names by its iteration (``iter_0000100``)
is the shortened run's (``iter_0000010``). A command fails on a nonzero exit or "command
not found". W&B runs offline (``WANDB_MODE=offline``: no network here); a command that
turns on a logging backend whose extra is not installed (:data:`NEEDS_MODULE`; the nox
sessions install none) is left out.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def _pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "examples" / "README.md", *sorted(ROOT.glob("docs/*.md"))]


def _console_scripts() -> set[str]:
    names: set[str] = set()
    for project in ROOT.glob("packages/*/pyproject.toml"):
        data = tomllib.loads(project.read_text())
        names |= set(data.get("project", {}).get("scripts", {}))
    return names


SCRIPTS = _console_scripts()

#: ``(pattern searched in the command, why it is not run here)``.
NOT_RUN: tuple[tuple[str, str], ...] = (
    (r"^uv run nox\b", "the whole test suite: CI runs it (and it would run this test again)"),
    (r"\bpytest\b", "runs tests, which CI and the extended tier run themselves"),
    (r"^(pip|pip3) install\b", "installs from the package index (no network here)"),
    (r"^uv sync\b", "changes the virtual environment every other command runs in"),
    (r"\bpip install\b.*--target", "runs on the GPU machine (device tool), see docs/gpu.md"),
    (r"benchmarks/gpu/wheels\.py --download", "downloads wheels from the package index"),
    (r"^curl\b", "queries a running job's HTTP endpoint (no job is running)"),
    (r"\.\.\.", "a placeholder ('...') for the user's own script or arguments"),
    (r"\btrain\.py\b", "a placeholder for the user's own training script"),
    (r"--nnodes[= ]2\b", "one command per node, started together (tests/test_train_multinode.py)"),
    (
        r"--nnodes[= ]1:2\b",
        "one command per machine (node-a, node-b); the elastic drill of "
        "tests/test_train_multinode.py runs it on one machine",
    ),
    (
        r"^ft_launcher\b",
        "needs nvidia-resiliency-ext, which cannot share a venv with megatron-core",
    ),
    (r"\bsbatch\b", "submits to a SLURM cluster (tests/test_slurm.py submits to one it starts)"),
    (r"\bscontrol\b|srun_requeueable|^export BRIDGE_STOP_SIGNAL", "a line of a SLURM batch script"),
    (r"^kubectl\b", "needs a Kubernetes cluster with Kubeflow Trainer"),
    (
        r"^torchrun -m bridge\.train$",
        "what each pod of the Kubernetes TrainJob runs (examples/k8s)",
    ),
    (r"corpus\.jsonl|tok/sp\.model|my_corpus|data/corpus\b", "names the user's own corpus"),
    (r"\bmy(_run)?\.yaml\b", "names the user's own recipe file"),
)

#: ``(pattern, module)``: a command that turns on an optional backend runs only where its
#: extra is installed (the nox sessions install none of bridge-logging's).
NEEDS_MODULE: tuple[tuple[str, str], ...] = (
    (r"logger\.wandb_project=", "wandb"),
    (r"logger\.mlflow_experiment=", "mlflow"),
    (r"logger\.comet_project=", "comet_ml"),
)

_SHELL_OPERATORS = {">", ">>", "<", "|", "&&", "||", ";", "2>", "2>&1", "&"}


@dataclass(frozen=True)
class DocCommand:
    """One command shown in a page."""

    page: str
    line: int
    text: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


_FENCE = re.compile(r"^\s*```(\w*)\s*$")
_SPAN = re.compile(r"`([^`\n]+(?:\n[^`\n]+)*)`")


def _inline_is_command(span: str) -> bool:
    if span.startswith(("uv run ", "torchrun ")):
        return True
    if span.startswith("examples/"):
        return span.split()[0].endswith(".sh")
    first, _, rest = span.partition(" ")
    return first in SCRIPTS and bool(rest.strip())


def extract(page: Path) -> list[DocCommand]:
    """The commands of ``page`` in reading order (see the module docstring)."""
    name = str(page.relative_to(ROOT))
    found: list[DocCommand] = []
    prose = []
    language: str | None = None
    pending = ""
    start = 0
    for number, raw in enumerate(page.read_text().splitlines(), 1):
        fence = _FENCE.match(raw)
        if fence and language is None:
            language = fence.group(1)
            prose.append("")
            continue
        if raw.strip() == "```" and language is not None:
            language = None
            prose.append("")
            continue
        if language is None:
            prose.append(raw)
            continue
        prose.append("")
        text = raw.strip()
        if language == "" and not pending and not text.startswith(("uv run ", "torchrun ")):
            continue  # an untagged block: its lines that are commands count, not its output
        if language not in ("bash", "sh", "shell", "console", ""):
            continue
        if language == "console":
            if not text.startswith("$ "):
                continue
            text = text[2:]
        if not pending:
            start = number
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        text = (pending + text).strip()
        pending = ""
        if text and not text.startswith("#"):
            found.append(DocCommand(name, start, " ".join(text.split())))
    joined = "\n".join(prose)
    for match in _SPAN.finditer(joined):
        span = " ".join(match.group(1).split())
        if _inline_is_command(span):
            line = joined.count("\n", 0, match.start()) + 1
            found.append(DocCommand(name, line, span))
    return sorted(found, key=lambda c: c.line)


ALL = [command for page in _pages() for command in extract(page)]


def not_run_reason(command: DocCommand) -> str | None:
    """Why ``command`` is not run here, or None."""
    for pattern, reason in NOT_RUN:
        if re.search(pattern, command.text):
            return reason
    return None


RUN = [c for c in ALL if not_run_reason(c) is None]


@dataclass(frozen=True)
class Invocation:
    """A command split into its parts (the first simple command of a shell line)."""

    env: dict[str, str]
    uv_run: bool
    argv: list[str]
    simple: bool  # no shell operators: the command is exactly env + argv


def parse(text: str) -> Invocation:
    lexer = shlex.shlex(text, posix=True, punctuation_chars="|&;<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    tokens = list(lexer)
    simple = not any(t in _SHELL_OPERATORS for t in tokens)
    for i, token in enumerate(tokens):
        if token in _SHELL_OPERATORS:
            tokens = tokens[:i]
            break
    env: dict[str, str] = {}
    while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):
        key, _, value = tokens.pop(0).partition("=")
        env[key] = value
    uv_run = tokens[:2] == ["uv", "run"]
    return Invocation(env, uv_run, tokens[2:] if uv_run else tokens, simple)


@dataclass(frozen=True)
class TrainLaunch:
    """A command that runs ``bridge-train``: its arguments and world size."""

    args: list[str]
    world: int
    prefix: list[str]  # everything before the arguments (program, launcher options)


def _torchrun_world(options: list[str]) -> int:
    nproc, nodes = 1, 1
    for i, option in enumerate(options):
        key, _, value = option.partition("=")
        if not value and i + 1 < len(options):
            value = options[i + 1]
        if key in ("--nproc_per_node", "--nproc-per-node"):
            nproc = int(value)
        elif key == "--nnodes":
            nodes = int(value.split(":")[-1])
    return nproc * nodes


def train_launch(invocation: Invocation) -> TrainLaunch | None:
    """The ``bridge-train`` arguments of a command, or None for another program."""
    argv = invocation.argv
    if not argv:
        return None
    program = argv[0]
    if program == "bridge-train":
        return TrainLaunch(argv[1:], 1, argv[:1])
    if program in ("python", "python3") and argv[1:3] == ["-m", "bridge.train"]:
        return TrainLaunch(argv[3:], 1, argv[:3])
    if program == "torchrun" and "-m" in argv:
        at = argv.index("-m")
        if argv[at + 1 : at + 2] == ["bridge.train"]:
            world = _torchrun_world(argv[1:at])
            return TrainLaunch(argv[at + 2 :], world, argv[: at + 2])
    if program.endswith("pretrain_text_corpus.sh"):
        args = argv[1:]
        corpus = args[:1] if args and "=" not in args[0] and not args[0].startswith("-") else []
        world = int(invocation.env.get("NPROC", "1"))
        recipe = str(ROOT / "examples" / "recipes" / "gpt_text_corpus.yaml")
        return TrainLaunch(["--config", recipe, *args[len(corpus) :]], world, [program, *corpus])
    return None


# ----------------------------------------------------------------------- the default tier


def test_the_pages_are_read_and_every_not_run_entry_is_used() -> None:
    pages = {c.page for c in ALL}
    assert {"README.md", "docs/quickstart.md", "docs/training.md"} <= pages, sorted(pages)
    assert len(ALL) > 80, len(ALL)
    stale = [p for p, _ in NOT_RUN if not any(re.search(p, c.text) for c in ALL)]
    assert not stale, f"NOT_RUN entries that match no command any more: {stale}"


#: Programs every shell has (a page may create a directory before a command writes to it).
_SHELL_COMMANDS = frozenset({"bash", "sh", "mkdir", "cd", "export", "echo", "ls", "cat"})


def _found(invocation: Invocation) -> str | None:
    """Why the shell would not find the program, or None."""
    if not invocation.argv:
        return "no command"
    program = invocation.argv[0]
    if invocation.uv_run:
        if (VENV_BIN / program).exists() or (ROOT / program).is_file():
            return None
        return f"`uv run {program}`: no such console script or file in the workspace"
    if "/" in program:
        path = ROOT / program
        if path.is_file() and os.access(path, os.X_OK):
            return None
        return f"{program}: no such executable file"
    if program in _SHELL_COMMANDS:
        return None
    return (
        f"`{program}`: command not found outside an activated virtual environment; write "
        f"`uv run {program} ...` (as the README's first command)"
    )


@pytest.mark.parametrize("command", RUN, ids=lambda c: c.id)
def test_command_is_found_as_written(command: DocCommand) -> None:
    problem = _found(parse(command.text))
    assert problem is None, f"{command.id}: {command.text}\n{problem}"


def _produced_later(path: str) -> bool:
    """A path a command reads that an earlier command of its page writes (a run's config)."""
    return path.startswith(("/tmp/", "runs/", "data/")) or not (ROOT / path).exists()


def _validate(launch: TrainLaunch) -> None:
    from bridge.config import load_config
    from bridge.train.cli import _config_from_first_argument, build_parser, run
    from bridge.train.recipes import recipe_path

    parser = build_parser()
    args = parser.parse_intermixed_args(launch.args)
    _config_from_first_argument(args, parser)
    if args.print_config:
        if args.config is not None and _produced_later(args.config):
            return
        with contextlib.redirect_stdout(io.StringIO()):
            assert run(launch.args) == 0
        return
    if args.config is not None:
        if _produced_later(args.config):
            return
        path = ROOT / args.config
    else:
        path = recipe_path(args.recipe or "tiny_gpt")
    cfg = load_config(path, args.overrides)
    from bridge.train.loop.pretrain_mimo import MimoModelConfig, check_mimo_config

    if isinstance(cfg.model, MimoModelConfig):  # as the command: the layout decides
        check_mimo_config(cfg, launch.world)
    else:
        cfg.validate(launch.world)


_TOOLS = ("bridge-preprocess-data", "bridge-convert")


@pytest.mark.timeout(600)
def test_training_and_tool_commands_parse_and_validate(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from bridge.config import ConfigError
    from bridge.train.convert.cli import build_parser as convert_parser
    from bridge.train.data.preprocess import build_parser as preprocess_parser

    monkeypatch.chdir(ROOT)
    failures = []
    checked = 0
    for command in RUN:
        invocation = parse(command.text)
        launch = train_launch(invocation)
        try:
            if launch is not None:
                if {"--help", "-h", "--version"} & set(launch.args):
                    with pytest.raises(SystemExit) as info:
                        _validate(launch)
                    assert info.value.code == 0
                else:
                    _validate(launch)
            elif invocation.argv and invocation.argv[0] in _TOOLS:
                parser = (
                    preprocess_parser()
                    if invocation.argv[0] == "bridge-preprocess-data"
                    else convert_parser()
                )
                parser.parse_args(invocation.argv[1:])
            else:
                continue
        except (ConfigError, SystemExit, AssertionError) as exc:
            failures.append(f"{command.id}: {command.text}\n  {type(exc).__name__}: {exc}")
        checked += 1
        capsys.readouterr()
    assert checked > 30, checked
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------- the extended tier

_ITERATION_FIELDS = (
    "train.train_iters",
    "train.exit_interval",
    "train.eval_interval",
    "checkpoint.save_interval",
    "checkpoint.non_persistent_save_interval",
)
_SHORTER = 10
_WARMUP_FIELD = "scheduler.lr_warmup_iters"


def _is_int_arg(arg: str, field: str) -> bool:
    key, sep, value = arg.partition("=")
    return bool(sep) and key == field and value.isdigit()


def _recipe_iterations(args: list[str], cwd: Path) -> int | None:
    from bridge.config import ConfigError, load_config
    from bridge.train.cli import _config_from_first_argument, build_parser
    from bridge.train.recipes import recipe_path

    parser = build_parser()
    try:
        parsed = parser.parse_intermixed_args(args)
        _config_from_first_argument(parsed, parser)
        path = (
            cwd / parsed.config
            if parsed.config is not None
            else recipe_path(parsed.recipe or "tiny_gpt")
        )
        train = load_config(path).train
    except (ConfigError, SystemExit, KeyError):
        return None
    return None if train is None else train.train_iters


_ITERATION_DIR = re.compile(r"\biter_(\d{7})\b")


def shortened(command: DocCommand, cwd: Path) -> str:
    """The command to run: iteration counts of a training command divided by 10."""
    text = command.text.replace("/tmp/", f"{cwd}/tmp/")
    # The run that wrote iter_N was shortened too: its checkpoint is at N / 10.
    text = _ITERATION_DIR.sub(lambda m: f"iter_{math.ceil(int(m.group(1)) / _SHORTER):07d}", text)
    invocation = parse(text)
    launch = train_launch(invocation)
    if launch is None or not invocation.simple:
        return text
    if {"--help", "-h", "--version", "--print-config", "--dry-run"} & set(launch.args):
        return text
    args = []
    has_length = False
    # A shortened run still decays past its warmup (the scheduler refuses warmup >= decay).
    warmup = max(
        (int(a.partition("=")[2]) for a in launch.args if _is_int_arg(a, _WARMUP_FIELD)),
        default=0,
    )
    for arg in launch.args:
        key, sep, value = arg.partition("=")
        if sep and key in _ITERATION_FIELDS and value.isdigit():
            least = warmup + 1 if key == "train.train_iters" else 1
            arg = f"{key}={max(least, math.ceil(int(value) / _SHORTER))}"
            has_length = has_length or key == "train.train_iters"
        args.append(arg)
    if not has_length:
        iterations = _recipe_iterations(launch.args, cwd)
        if iterations:
            args.append(f"train.train_iters={max(1, math.ceil(iterations / _SHORTER))}")
    if launch.prefix[0].endswith("pretrain_text_corpus.sh"):
        args = args[2:]  # the script names its own recipe
    words = [
        *(f"{k}={v}" for k, v in invocation.env.items()),
        *(["uv", "run"] if invocation.uv_run else []),
        *launch.prefix,
        *args,
    ]
    return shlex.join(words)


def _page_environment(work: Path) -> dict[str, str]:
    shim = work / ".bin"
    shim.mkdir()
    uv = shim / "uv"
    uv.write_text(
        "#!/bin/sh\n"
        "# uv run: the command with the project's environment first on PATH, as in a clone.\n"
        f'if [ "$1" = run ]; then shift; PATH="{VENV_BIN}:$PATH" exec "$@"; fi\n'
        'echo "uv $1: not available in the docs-commands test" >&2\n'
        "exit 97\n"
    )
    uv.chmod(0o755)
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if Path(p) != VENV_BIN]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "RANK", "WORLD_SIZE")}
    env["PATH"] = os.pathsep.join([str(shim), *path])
    env["WANDB_MODE"] = "offline"  # no network here (docs/logging.md: a run written locally)
    return env


def _missing_module(command: DocCommand) -> str | None:
    import importlib.util

    for pattern, module in NEEDS_MODULE:
        if re.search(pattern, command.text) and importlib.util.find_spec(module) is None:
            return module
    return None


@pytest.mark.extended
@pytest.mark.timeout(14400)
@pytest.mark.parametrize("page", sorted({c.page for c in RUN}))
def test_page_commands_run_as_written(page: str, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    # What the pages run from a clone: the examples, the benchmarks and the resiliency drill.
    for folder in ("examples", "benchmarks", "packages/bridge-resiliency/tests"):
        shutil.copytree(ROOT / folder, work / folder, ignore=shutil.ignore_patterns("__pycache__"))
    (work / "tmp").mkdir()
    env = _page_environment(work)
    for command in [c for c in RUN if c.page == page]:
        if _missing_module(command) is not None:
            continue  # its extra is not installed in this environment
        text = shortened(command, work)
        proc = subprocess.run(
            ["bash", "-c", text],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=3600,
        )
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0 and "command not found" not in output, (
            f"{command.id}: {command.text}\nran: {text}\nexit {proc.returncode}\n{output[-4000:]}"
        )
