"""Shared fixtures: launching fault drills and the uninterrupted reference runs."""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from core_utils.testing import find_free_port, run_distributed

# The drill's trainer is a test helper beside this file (not part of the package); test
# modules import it by name, and launchers run it as a script.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from resiliency_drill import (
    StepCheckpointer,
    TinyRunOptions,
    TinyRunResult,
    read_events,
    run_tiny_training,
)

DRILL_SCRIPT = str(Path(__file__).resolve().with_name("resiliency_drill.py"))

HAS_NVRX = importlib.util.find_spec("nvidia_resiliency_ext") is not None

_FAULT_BANNER = re.compile(
    r"simulating fault '(?P<type>\w+)' on rank (?P<rank>\d+) \(pid (?P<pid>\d+)\) after "
    r"[\d.]+ s, at unix time (?P<time>[\d.]+)"
)
_WATCHDOG_KILL = re.compile(
    r"HangWatchdog: rank (?P<rank>\d+) \(pid (?P<pid>\d+)\) made no progress for "
    r"(?P<timeout>[\d.]+) s in phase '(?P<phase>[^']+)'; .*\(at unix time (?P<time>[\d.]+)\)"
)
_RANK_MONITOR_TIMEOUT = re.compile(
    r"\[(?P<asctime>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\] \[WARNING\] \[[^\]]+\] "
    r"(?:Section '\w+' has been open|Was out of section) for [\d.]+ seconds\. "
    r"Timeout is (?P<timeout>[\d.]+) seconds\."
)


@pytest.fixture
def nvrx() -> None:
    """Skip where nvidia-resiliency-ext is not installed.

    It cannot share a venv with megatron-core 0.19 (the workspace venv); the package's
    own nox session, ``nox -s 'tests(bridge-resiliency)'``, installs the nvrx extra and
    runs these tests.
    """
    if not HAS_NVRX:
        pytest.skip(
            "nvidia-resiliency-ext is not installed in this venv (it cannot share one with "
            "megatron-core 0.19); run `nox -s 'tests(bridge-resiliency)'`"
        )


def child_env(**extra: str) -> dict[str, str]:
    """Environment for launched ranks.

    The image sets PYTHONDONTWRITEBYTECODE, so every new interpreter would compile torch
    from source (seconds per process). A bytecode cache outside the venv keeps launches
    and restarts fast without writing into the environment.
    """
    env = dict(os.environ)
    env["PYTHONDONTWRITEBYTECODE"] = ""
    env["PYTHONPYCACHEPREFIX"] = str(Path.home() / ".cache" / "bridge-resiliency-tests-pyc")
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def option_args(options: TinyRunOptions) -> list[str]:
    """Command-line arguments of ``resiliency_drill.py`` for ``options``."""
    args: list[str] = []
    defaults = TinyRunOptions(save_dir=options.save_dir)
    for name, value in vars(options).items():
        if name != "save_dir" and value == getattr(defaults, name):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            if value:
                args.append(flag)
        elif name == "fault_plan":
            args += [flag, ",".join(value)]
        elif value is not None:
            args += [flag, str(value)]
    return args


def _reference_rank(rank: int, world: int, options: TinyRunOptions) -> TinyRunResult:
    torch.set_num_threads(1)
    return run_tiny_training(options)


@functools.cache
def _reference(train_iters: int, world: int, root: str) -> tuple[TinyRunResult, ...]:
    save_dir = Path(root) / f"reference-{train_iters}-{world}"
    options = TinyRunOptions(save_dir=str(save_dir), train_iters=train_iters)
    return tuple(run_distributed(_reference_rank, world, options, timeout=180))


@pytest.fixture(scope="session")
def reference(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[int, int], tuple[TinyRunResult, ...]]:
    """``reference(train_iters, world)``: per-rank results of an uninterrupted run."""
    root = str(tmp_path_factory.mktemp("reference"))

    def run(train_iters: int, world: int = 2) -> tuple[TinyRunResult, ...]:
        return _reference(train_iters, world, root)

    return run


class Drill:
    """Helpers of the fault-drill tests (test modules cannot import conftest)."""

    @staticmethod
    def assert_matches_reference(
        save_dir: Path, log_dir: Path, reference: Sequence[TinyRunResult], train_iters: int
    ) -> list[dict[str, Any]]:
        """Check a faulted run: every logged loss and the final weights equal the reference.

        Returns:
            The events of the run.
        """
        events = read_events(log_dir)
        expected = reference[0].losses
        steps = [e for e in events if e["event"] == "step"]
        assert steps, "the run logged no step"
        for event in steps:
            assert event["loss"] == expected[event["iteration"]], event
        final = StepCheckpointer(save_dir, rank=0).load()
        assert final is not None and final.iteration == train_iters
        for name, tensor in reference[0].state.items():
            assert torch.equal(final.state["model"][name], tensor), name
        # Each attempt resumed where the last complete checkpoint of the previous one was, and
        # trained every following iteration exactly once until it stopped.
        starts = [e for e in events if e["event"] == "start"]
        saved_before: dict[int, int] = {}
        for start in starts:
            attempt = start["attempt"]
            prior = [
                e["iteration"] for e in events if e["event"] == "saved" and e["attempt"] < attempt
            ]
            saved_before[attempt] = max(prior, default=0)
            assert start["iteration"] == saved_before[attempt], (start, prior)
            trained = [e["iteration"] for e in steps if e["attempt"] == attempt]
            first = start["iteration"] + 1
            assert trained == list(range(first, first + len(trained))), (attempt, trained)
        return events

    @staticmethod
    @contextlib.contextmanager
    def launched(
        cmd: Sequence[str], *, log: Path, env: dict[str, str] | None = None
    ) -> Iterator[subprocess.Popen[bytes]]:
        """Start ``cmd`` in its own session with output to ``log``; kill the session on exit.

        The working directory is the log's, so launchers' stray files stay in ``tmp_path``.
        """
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                list(cmd),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=child_env() if env is None else env,
                cwd=log.parent,
                start_new_session=True,
            )
            try:
                yield proc
            finally:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)

    @staticmethod
    def wait_for(proc: subprocess.Popen[bytes], timeout: float, log: Path) -> int:
        """Wait for ``proc``; on timeout fail with the tail of its log."""
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"launch did not finish within {timeout} s; log tail:\n{Drill.tail(log)}")

    @staticmethod
    def wait_until(
        condition: Callable[[], bool], timeout: float, what: str, log: Path | None = None
    ) -> None:
        """Poll ``condition`` every 50 ms until true; fail after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                pytest.fail(
                    f"timed out waiting for {what}" + (f"; log:\n{Drill.tail(log)}" if log else "")
                )
            time.sleep(0.05)

    option_args = staticmethod(option_args)

    detection_slack = 5.0
    """How much later than the timeout in force a hang may be detected. The rank monitor
    checks every ``--ft-workload-check-interval`` (1 s in these drills, added separately),
    the watchdog wakes at its deadline; the rest covers scheduling delays on a loaded
    2-core machine."""

    @staticmethod
    def faults(output: str, fault_type: str) -> list[dict[str, Any]]:
        """The simulated faults of ``fault_type`` in a launch log: rank, pid and the unix
        time at which the rank stopped (each banner is printed to stdout and stderr)."""
        found: dict[int, dict[str, Any]] = {}
        for match in _FAULT_BANNER.finditer(output):
            if match["type"] == fault_type:
                found[int(match["pid"])] = {
                    "rank": int(match["rank"]),
                    "pid": int(match["pid"]),
                    "time": float(match["time"]),
                }
        return sorted(found.values(), key=lambda fault: fault["time"])

    @staticmethod
    def watchdog_kills(output: str) -> list[dict[str, Any]]:
        """The HangWatchdog detections in a launch log: rank, pid, phase, timeout, time."""
        return [
            {
                "rank": int(m["rank"]),
                "pid": int(m["pid"]),
                "phase": m["phase"],
                "timeout": float(m["timeout"]),
                "time": float(m["time"]),
            }
            for m in _WATCHDOG_KILL.finditer(output)
        ]

    @staticmethod
    def rank_monitor_timeouts(output: str) -> list[dict[str, float]]:
        """The timeouts nvidia-resiliency-ext's rank monitors reported (they then kill the
        rank): the unix time of the report and the timeout that elapsed."""
        return [
            {
                # The monitor logs local time, like datetime.timestamp() reads it.
                "time": datetime.datetime.strptime(
                    m["asctime"], "%Y-%m-%d %H:%M:%S,%f"
                ).timestamp(),
                "timeout": float(m["timeout"]),
            }
            for m in _RANK_MONITOR_TIMEOUT.finditer(output)
        ]

    @staticmethod
    def tail(log: Path, chars: int = 6000) -> str:
        """The end of a log file."""
        return log.read_text(errors="replace")[-chars:] if log.exists() else "<no log>"

    @staticmethod
    def torchrun_cmd(nproc: int, extra: Sequence[str], options: TinyRunOptions) -> list[str]:
        """``python -m torch.distributed.run ... resiliency_drill.py <options>``."""
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            "--master-addr=127.0.0.1",
            f"--master-port={find_free_port()}",
            "--monitor-interval=0.5",
            *extra,
            DRILL_SCRIPT,
            *option_args(options),
        ]

    @staticmethod
    def ft_launcher_cmd(nproc: int, extra: Sequence[str], options: TinyRunOptions) -> list[str]:
        """``ft_launcher ... resiliency_drill.py <options>`` of this interpreter."""
        launcher = Path(sys.executable).with_name("ft_launcher")
        return [
            str(launcher),
            f"--nproc-per-node={nproc}",
            "--ft-enable-nic-monitor=false",
            "--ft-workload-check-interval=1",
            "--monitor-interval=1",
            f"--rdzv-endpoint=127.0.0.1:{find_free_port()}",
            *extra,
            DRILL_SCRIPT,
            *option_args(options),
        ]


@pytest.fixture
def drill() -> Drill:
    """Launch helpers for fault drills."""
    return Drill()
