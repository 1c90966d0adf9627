"""Fault drills against the real trainer (issue 6, "Real fault tests"): CPU, gloo, 2 ranks.

Each drill injects a real fault into ``bridge-train`` (``python -m bridge.train`` under
``torchrun``) or into ``bridge.train.pretrain`` on forked ranks, and compares the losses with
an uninterrupted reference run of the same config, bit for bit:

* SIGTERM to one rank: every rank stops at the same iteration, saves it once, exits 0; a
  second SIGTERM during that save changes nothing; the same command resumes exactly.
* a hung rank (SIGSTOP after a checkpoint, or ``ft.simulate_fault`` with ``rank_hung``):
  the built-in watchdog (``--hang-timeout``) kills it within its timeout; ``torchrun
  --max-restarts=1`` restarts the job from its last complete checkpoint, and without
  restarts the job is torn down.
* a straggler (one rank's forward pass sleeps): the straggler report names it.
* a SIGKILL in the middle of a checkpoint save: the previous checkpoint is the one loaded.

The SIGKILL-under-``torchrun --max-restarts`` drill is
``tests/test_train_resume.py::test_torchrun_restarts_a_killed_rank_and_finishes``; it uses
the launch helpers and the shared reference run defined here.

Launches that need a per-attempt fault or a paused save run the ``bridge-train`` command
through a small entry script (:data:`ENTRY_SCRIPT`): it calls ``bridge.train.cli.main``
with the same arguments and adds only the test's hooks.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest

from bridge.config import load_config
from bridge.train import forward_step, pretrain
from bridge.train.recipes import recipe_path
from core_utils.testing import DistributedTestError, find_free_port, run_distributed

# --------------------------------------------------------------------------- the drill config

TRAIN_ITERS = 120
#: Overrides of the built-in ``tiny_gpt`` recipe shared by every drill (and the reference):
#: a 2-layer GPT, tens of milliseconds per iteration on 2 CPU ranks.
DRILL_OVERRIDES: tuple[str, ...] = (
    f"train.train_iters={TRAIN_ITERS}",
    "train.eval_interval=null",
    "train.eval_iters=0",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.seq_length=64",
    "scheduler.lr_warmup_iters=2",
)
TRACKER = "latest_checkpointed_iteration.txt"

_REFERENCE: dict[int, float] = {}


def _reference_rank(rank: int, world: int, metrics: str) -> int:
    return pretrain(
        load_config(recipe_path("tiny_gpt"), list(DRILL_OVERRIDES)), metrics_file=metrics
    )


def reference_losses() -> dict[int, float]:
    """Per-iteration ``lm loss`` of an uninterrupted 2-rank run of the drill config.

    Computed once per test session on forked ranks (``pretrain``; the ``bridge-train``
    command under ``torchrun`` gives the same losses bit for bit) and shared by the drills.
    """
    if not _REFERENCE:
        with tempfile.TemporaryDirectory() as tmp:
            metrics = Path(tmp) / "metrics.jsonl"
            codes = run_distributed(_reference_rank, 2, str(metrics), timeout=400)
            assert codes == [0, 0]
            losses = dict(loss_records(metrics))
        assert sorted(losses) == list(range(1, TRAIN_ITERS + 1))
        _REFERENCE.update(losses)
    return dict(_REFERENCE)


def loss_records(metrics: Path) -> list[tuple[int, float]]:
    """``(iteration, lm loss)`` of every record of a ``--metrics-file``, in file order.

    Safe while the file is being written: a last line without its newline is left out.
    """
    if not metrics.exists():
        return []
    text = metrics.read_text(encoding="utf-8")
    complete = text[: text.rfind("\n") + 1]
    records = [json.loads(line) for line in complete.splitlines() if line.strip()]
    return [(int(r["step"]), r["lm loss"]) for r in records if "lm loss" in r]


def assert_losses_match(records: Sequence[tuple[int, float]], reference: dict[int, float]) -> None:
    """Every recorded loss equals the reference run's loss of that iteration, bit for bit."""
    for step, loss in records:
        assert loss == reference[step], (
            f"iteration {step}: {loss!r} != reference {reference[step]!r}"
        )


def assert_restarted_from(steps: Sequence[int], resumed_from: int) -> None:
    """The logged iterations of a launch with one restart: the first attempt logged
    ``1..k`` (``k >= resumed_from``; its records after the last flush may be lost with
    the rank), the restart ``resumed_from + 1`` to the end, and no iteration is missing."""
    # The restart's first record is the first that does not increase; none such: k == resumed_from.
    k = next((i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]), resumed_from)
    assert k >= resumed_from, (k, resumed_from)
    expected = [*range(1, k + 1), *range(resumed_from + 1, TRAIN_ITERS + 1)]
    assert list(steps) == expected, (steps, resumed_from)


def loaded_message(save: Path, iteration: int) -> str:
    """What rank 0 logs when it loads the checkpoint of ``iteration`` from ``save``."""
    return f"checkpoint of iteration {iteration} from {save / f'iter_{iteration:07d}'} ("


def tracker_iteration(save: Path) -> int | None:
    """The iteration the checkpoint tracker names (``None`` without a tracker)."""
    tracker = save / TRACKER
    return int(tracker.read_text().strip()) if tracker.exists() else None


def progress_entries(save: Path) -> list[int | None]:
    """``progress.txt`` in order: ``None`` for a launch start, the iteration of each save."""
    entries: list[int | None] = []
    for line in (save / "progress.txt").read_text().splitlines():
        fields = line.split("\t")
        if fields[3] == "Starting job":
            entries.append(None)
        elif fields[3] == "Saved checkpoint":
            entries.append(int(fields[4].split(": ")[1]))
    return entries


# --------------------------------------------------------------------------- launching


#: Runs the ``bridge-train`` command (``bridge.train.cli.main``) with the drills' hooks, each
#: switched on by an environment variable:
#:
#: * ``DRILL_FIRST_ATTEMPT_OVERRIDES``: overrides added on the first launch attempt only
#:   (``TORCHELASTIC_RESTART_COUNT`` 0), for a fault that must not recur after a restart;
#: * ``DRILL_FIRST_ATTEMPT_STEP_SLEEP``: on the first attempt, the forward step (the
#:   ``forward_step_func`` of ``pretrain``) sleeps this many seconds before the default one,
#:   so a fault due some seconds after setup lands mid-run however fast the machine is
#:   (the losses do not change);
#: * ``DRILL_SAVE_GATE``: every rank announces each checkpoint save
#:   (``<gate>.saving.rank<r>``, holding the directory) and waits inside it until the file
#:   ``<gate>`` exists, so a test can act while a save is in progress.
ENTRY_SCRIPT = """\
import os
import sys
import time
from pathlib import Path


def _hold_saves(gate):
    from megatron.core import dist_checkpointing

    write = dist_checkpointing.save

    def held_save(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        Path(f"{gate}.saving.rank{os.environ['RANK']}").write_text(str(checkpoint_dir))
        deadline = time.monotonic() + 120
        while not Path(gate).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return write(sharded_state_dict, checkpoint_dir, *args, **kwargs)

    dist_checkpointing.save = held_save


def _slow_steps(seconds):
    import importlib

    from bridge.train import forward_step

    # (the package re-exports the function under the module's name)
    module = importlib.import_module("bridge.train.loop.pretrain")

    pretrain = module.pretrain

    def slow_step(state, data_iterator, model):
        time.sleep(seconds)
        return forward_step(state, data_iterator, model)

    def slow_pretrain(config, forward_step_func=forward_step, **kwargs):
        assert forward_step_func is forward_step
        return pretrain(config, slow_step, **kwargs)

    module.pretrain = slow_pretrain


if __name__ == "__main__":
    argv = sys.argv[1:]
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        argv += os.environ.get("DRILL_FIRST_ATTEMPT_OVERRIDES", "").split()
        if os.environ.get("DRILL_FIRST_ATTEMPT_STEP_SLEEP"):
            _slow_steps(float(os.environ["DRILL_FIRST_ATTEMPT_STEP_SLEEP"]))
    if os.environ.get("DRILL_SAVE_GATE"):
        _hold_saves(os.environ["DRILL_SAVE_GATE"])
    from bridge.train.cli import main

    main(argv)
"""


def torchrun_command(
    args: Sequence[str], *, max_restarts: int = 0, entry: Path | None = None
) -> list[str]:
    """``torchrun`` on 2 local ranks running ``bridge-train args`` (or ``entry args``)."""
    target = [str(entry)] if entry is not None else ["-m", "bridge.train"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--max-restarts={max_restarts}",
        "--master-addr=127.0.0.1",
        f"--master-port={find_free_port()}",
        *target,
        "--no-print-config",
        *args,
    ]


def write_entry_script(directory: Path) -> Path:
    """Write :data:`ENTRY_SCRIPT` into ``directory`` and return its path."""
    path = directory / "drill_entry.py"
    path.write_text(ENTRY_SCRIPT)
    return path


@contextlib.contextmanager
def launched(
    cmd: Sequence[str], *, log: Path, cwd: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``cmd`` with its output in ``log``; on exit kill whatever the launch left.

    Output goes to a file (a process a killed rank forked may outlive it and would hold a
    pipe open). The launcher gets a session of its own; the ranks torchrun starts get theirs,
    so leftovers are also found by ``cwd`` (unique to the test) in their command lines.
    """
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    # The machine may set PYTHONDONTWRITEBYTECODE: every rank would then compile torch again.
    child_env["PYTHONDONTWRITEBYTECODE"] = ""
    with log.open("w") as out:
        proc = subprocess.Popen(
            list(cmd),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=child_env,
            cwd=cwd,
            start_new_session=True,
        )
        try:
            yield proc
        finally:
            kill_group(proc.pid)
            kill_processes_mentioning(str(cwd))
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)


def kill_group(pgid: int) -> None:
    """SIGKILL every process left in the launch's process group and wait until it is empty."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.1)


def kill_processes_mentioning(marker: str) -> None:
    """SIGKILL processes of this launch that outlived it (found by a path unique to the test).

    A process a rank forked (dist_checkpointing's write-results helper) is re-parented when
    the rank is killed and lives in the rank's process group, not the launcher's.
    """
    for process in psutil.process_iter(["pid", "cmdline"]):
        cmdline = process.info.get("cmdline") or []
        if process.pid != os.getpid() and any(marker in part for part in cmdline):
            with contextlib.suppress(psutil.Error):
                process.kill()


def rank_processes(proc: subprocess.Popen[bytes]) -> dict[int, psutil.Process]:
    """The worker processes torchrun runs now, by global rank."""
    ranks: dict[int, psutil.Process] = {}
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(proc.pid).children():
            with contextlib.suppress(psutil.Error, KeyError, ValueError):
                ranks[int(child.environ()["RANK"])] = child
    return ranks


def wait_until(
    condition: Callable[[], bool],
    proc: subprocess.Popen[bytes],
    timeout: float,
    what: str,
    log: Path,
) -> None:
    """Poll ``condition`` until it holds; fail (with the log's tail) on timeout or exit."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"the launch exited ({proc.returncode}) before {what}:\n{tail(log)}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout:.0f} s:\n{tail(log)}")
        time.sleep(0.02)


def wait_for_exit(
    proc: subprocess.Popen[bytes],
    timeout: float,
    log: Path,
    seen: dict[int, psutil.Process] | None = None,
) -> int:
    """Wait for the launcher to exit (fail on timeout: a hang); return its exit code.

    ``seen`` collects every process the launch ran meanwhile (ranks and their children).
    """
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            pytest.fail(f"the launch did not end within {timeout:.0f} s (hang?):\n{tail(log)}")
        if seen is not None:
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(proc.pid).children(recursive=True):
                    seen.setdefault(child.pid, child)
        time.sleep(0.05)
    return proc.returncode


def left_running(processes: Iterable[psutil.Process], timeout: float) -> list[psutil.Process]:
    """The processes still running (zombies count as gone) after waiting up to ``timeout``."""

    def running(process: psutil.Process) -> bool:
        try:
            return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    remaining = list(processes)
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in remaining if running(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def tail(log: Path, chars: int = 6000) -> str:
    """The end of a launch's output."""
    return log.read_text(errors="replace")[-chars:] if log.exists() else "<no output>"


# --------------------------------------------------------------------------- 1. SIGTERM


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigterm_to_one_rank_saves_on_all_exits_zero_and_resumes_exactly(tmp_path: Path) -> None:
    """SIGTERM to rank 1 (not to torchrun): both ranks stop at the same iteration, save it
    once (a second SIGTERM to both ranks in the middle of that save is ignored), every process
    exits 0; the same command then resumes and every loss equals the uninterrupted run's."""
    reference = reference_losses()
    save, metrics, gate = tmp_path / "ckpt", tmp_path / "metrics.jsonl", tmp_path / "gate"
    args = [
        "--metrics-file",
        str(metrics),
        *DRILL_OVERRIDES,
        "train.exit_signal_handler=true",
        f"checkpoint.save={save}",
    ]
    cmd = torchrun_command(args, entry=write_entry_script(tmp_path))
    log = tmp_path / "first.log"
    # Steps of at least 20 ms: the signal surely comes before the end of the run.
    first_launch = {"DRILL_SAVE_GATE": str(gate), "DRILL_FIRST_ATTEMPT_STEP_SLEEP": "0.02"}
    with launched(cmd, log=log, cwd=tmp_path, env=first_launch) as proc:
        wait_until(
            lambda: any(step >= 12 for step, _ in loss_records(metrics)), proc, 240, "step 12", log
        )
        ranks = rank_processes(proc)
        signalled_at = max(step for step, _ in loss_records(metrics))
        ranks[1].send_signal(signal.SIGTERM)
        saving = [Path(f"{gate}.saving.rank{r}") for r in (0, 1)]
        wait_until(lambda: all(p.exists() for p in saving), proc, 60, "the exit save", log)
        # Both ranks are inside the save: signal them again (rank 1 for the second time).
        for rank in (0, 1):
            ranks[rank].send_signal(signal.SIGTERM)
        wait_until(
            lambda: (
                "rank 1 received SIGTERM again (2 times)" in log.read_text()
                and f"rank 0 (pid {ranks[0].pid}) received SIGTERM" in log.read_text()
            ),
            proc,
            60,
            "the second signals to be handled",
            log,
        )
        gate.touch()  # let the save go on
        returncode = wait_for_exit(proc, 120, log)
    output = log.read_text()
    assert returncode == 0, tail(log)
    assert f"rank 1 (pid {ranks[1].pid}) received SIGTERM: the job will save" in output

    # Every rank learnt of the signal and saved the same iteration, once.
    match = re.search(r"exiting after iteration (\d+): a rank received SIGTERM", output)
    assert match is not None, tail(log)
    stopped = int(match.group(1))
    assert signalled_at <= stopped < TRAIN_ITERS
    saved_dirs = {p.read_text() for p in saving}
    assert saved_dirs == {str(save / f"iter_{stopped:07d}.tmp")}, saved_dirs
    assert tracker_iteration(save) == stopped
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("iter_")) == [
        f"iter_{stopped:07d}"
    ]
    assert (save / f"iter_{stopped:07d}" / "checkpoint_complete.json").exists()
    shards = sorted(p.name for p in (save / f"iter_{stopped:07d}").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # written by both ranks
    first = loss_records(metrics)
    assert [step for step, _ in first] == list(range(1, stopped + 1))  # rank 1 stopped there

    # The same command resumes from the exit checkpoint and finishes exactly.
    log = tmp_path / "resume.log"
    with launched(cmd, log=log, cwd=tmp_path) as proc:
        returncode = wait_for_exit(proc, 240, log)
    assert returncode == 0, tail(log)
    assert loaded_message(save, stopped) in log.read_text()
    resumed = loss_records(metrics)[len(first) :]
    assert [step for step, _ in resumed] == list(range(stopped + 1, TRAIN_ITERS + 1))
    assert_losses_match(first + resumed, reference)
    assert resumed[-1] == (TRAIN_ITERS, reference[TRAIN_ITERS])
    assert tracker_iteration(save) == TRAIN_ITERS


# --------------------------------------------------------------------------- 3. hung rank

#: Timeouts with room for a loaded machine: a healthy rank descheduled for a few seconds (a
#: step, a pause between steps, a save) must not be taken for a hung one (a 4 s step timeout
#: killed a healthy rank in bridge-resiliency's drill beside two CPU hogs and other jobs).
HANG_TIMEOUT, HANG_SETUP_TIMEOUT, HANG_CHECKPOINT_TIMEOUT = 10.0, 60.0, 20.0
#: Allowed delay between the end of the configured timeout and the kill, as logged: the
#: watchdog polls every 0.5 s, and the two timestamps come from two processes that a loaded
#: 2-core machine may schedule late.
DETECTION_SLACK = 3.0
_FAULT = re.compile(r"simulating fault 'rank_hung' on rank 1 \(pid (\d+)\).*at unix time ([\d.]+)")
_KILL = re.compile(
    r"HangWatchdog: rank 1 \(pid (\d+)\) made no progress for ([\d.]+) s in phase '([^']+)';"
    r" sending SIGKILL.*\(at unix time ([\d.]+)\)"
)


def _hang_command(tmp_path: Path, args: Sequence[str], max_restarts: int) -> list[str]:
    options = [
        f"--hang-timeout={HANG_TIMEOUT}",
        f"--hang-setup-timeout={HANG_SETUP_TIMEOUT}",
        f"--hang-checkpoint-timeout={HANG_CHECKPOINT_TIMEOUT}",
    ]
    return torchrun_command(
        [*options, *DRILL_OVERRIDES, *args],
        max_restarts=max_restarts,
        entry=write_entry_script(tmp_path),
    )


_HANG_ON_FIRST_ATTEMPT = {
    # Rank 1 is SIGSTOPped 3 to 4.3 s after setup; steps of at least 50 ms put that before
    # iteration 86, so the job cannot finish first.
    "DRILL_FIRST_ATTEMPT_OVERRIDES": "ft.simulate_fault=true ft.simulated_fault_type=rank_hung "
    "ft.simulated_fault_rank=1 ft.simulated_fault_base_delay=3",
    "DRILL_FIRST_ATTEMPT_STEP_SLEEP": "0.05",
}


def _assert_hang_detected_in_time(output: str, hung: tuple[int, float] | None = None) -> None:
    """The watchdog killed the hung rank 1 within its phase's timeout plus the slack.

    ``hung`` is the pid and unix time of a stop the test made itself; without it, the
    simulated fault's banner gives them.
    """
    kill = _KILL.search(output)
    assert kill is not None, output[-6000:]
    if hung is None:
        fault = _FAULT.search(output)
        assert fault is not None, output[-6000:]
        hung = (int(fault.group(1)), float(fault.group(2)))
    assert int(kill.group(1)) == hung[0]  # the hung process is the one killed
    stated, phase = float(kill.group(2)), kill.group(3)
    timeout = {"checkpointing": HANG_CHECKPOINT_TIMEOUT, "setup": HANG_SETUP_TIMEOUT}.get(
        phase, HANG_SETUP_TIMEOUT if "warm-up" in phase else HANG_TIMEOUT
    )
    assert stated == timeout, (phase, stated)
    latency = float(kill.group(4)) - hung[1]
    assert 0 < latency <= timeout + DETECTION_SLACK, (phase, latency)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hung_rank_is_killed_by_the_watchdog_and_the_restart_resumes_exactly(
    tmp_path: Path,
) -> None:
    """Rank 1 hangs (SIGSTOP, from the test once the checkpoint of iteration 10 is complete:
    tied to progress, not to a delay a loaded machine may not meet) with ``--hang-timeout``
    and ``torchrun --max-restarts=1``: the watchdog kills the stopped rank within its
    timeout, torchrun restarts both ranks, they resume from the last complete checkpoint and
    every loss equals the reference."""
    reference = reference_losses()
    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    args = [
        "--metrics-file",
        str(metrics),
        f"checkpoint.save={save}",
        "checkpoint.save_interval=10",
    ]
    cmd = _hang_command(tmp_path, args, max_restarts=1)
    log = tmp_path / "torchrun.log"
    # Steps of at least 50 ms on the first attempt: 5.5 s at least from the checkpoint of 10
    # to the end, for the test to see that checkpoint and stop rank 1.
    with launched(
        cmd, log=log, cwd=tmp_path, env={"DRILL_FIRST_ATTEMPT_STEP_SLEEP": "0.05"}
    ) as proc:
        wait_until(lambda: (tracker_iteration(save) or 0) >= 10, proc, 300, "checkpoint of 10", log)
        rank1 = rank_processes(proc)[1]
        hung = (rank1.pid, time.time())
        rank1.suspend()  # SIGSTOP: every thread stops, as in a real hang
        stopped_after = tracker_iteration(save)  # no save completes without rank 1 now
        returncode = wait_for_exit(proc, 300, log)
    output = log.read_text()
    assert returncode == 0, tail(log)
    _assert_hang_detected_in_time(output, hung)

    # The restart loaded the last checkpoint the first attempt completed.
    progress = progress_entries(save)
    assert progress.count(None) == 2, progress
    restart = progress.index(None, 1)
    saved_before = [it for it in progress[:restart] if it is not None]
    # The tracker named it at the stop; its progress line may be missing (rank 0 writes that
    # line after a collective the stopped rank 1 never joined).
    assert stopped_after is not None
    last_complete = stopped_after
    assert saved_before in ([], [last_complete]), (progress, last_complete)
    assert loaded_message(save, last_complete) in output
    records = loss_records(metrics)
    assert_restarted_from([step for step, _ in records], last_complete)
    assert_losses_match(records, reference)
    assert tracker_iteration(save) == TRAIN_ITERS


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_hung_rank_without_restarts_tears_the_job_down(tmp_path: Path) -> None:
    """``rank_hung`` with ``--hang-timeout`` and no restarts left: the watchdog kills the
    hung rank, torchrun stops the other one and exits non-zero, and no process is left."""
    cmd = _hang_command(tmp_path, [], max_restarts=0)
    log = tmp_path / "torchrun.log"
    seen: dict[int, psutil.Process] = {}
    with launched(cmd, log=log, cwd=tmp_path, env=_HANG_ON_FIRST_ATTEMPT) as proc:
        returncode = wait_for_exit(proc, 180, log, seen)
        # Checked before the clean-up of `launched`: the launch itself left nothing behind.
        alive = left_running(seen.values(), timeout=15)
    assert not alive, [(p.pid, p.cmdline()) for p in alive]
    assert returncode != 0, tail(log)
    assert len(seen) >= 4, seen  # two ranks and their watchdogs were seen
    _assert_hang_detected_in_time(log.read_text())


# --------------------------------------------------------------------------- 4. straggler

STRAGGLER_SLEEP_S = 0.05
REPORT_INTERVAL = 3


def _straggler_rank(rank: int, world: int, port: int) -> dict[str, Any]:
    import logging
    import time as clock

    from bridge.config import LoggerConfig, StragglerDetectionConfig
    from bridge.train.testing import tiny_config_container, tiny_train_config

    class Lines(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.INFO)
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    lines = Lines()
    logging.getLogger("core_utils.straggler").addHandler(lines)
    reports: dict[int, tuple[int | None, float]] = {}
    slowed: list[Any] = []

    def slow_forward(_module: Any, _inputs: Any) -> None:
        clock.sleep(STRAGGLER_SLEEP_S)  # inside the timed forward pass, like a slow GPU

    def step(state: Any, data_iterator: Any, model: Any) -> Any:
        if rank == 1 and not slowed:
            slowed.append(model.register_forward_pre_hook(slow_forward))
        report = state.straggler_timing.last_report
        done = state.train_state.step
        if report is not None and done % REPORT_INTERVAL == 0:  # made after iteration `done`
            reports[done] = (state.straggler_timing.slowest_rank(), report.max_elapsed.value)
        return forward_step(state, data_iterator, model)

    cfg = tiny_config_container(
        train=tiny_train_config(train_iters=2 * REPORT_INTERVAL + 1),
        logger=LoggerConfig(log_interval=REPORT_INTERVAL),
        straggler=StragglerDetectionConfig(log_straggler=True, straggler_ctrlr_port=port),
    )
    code = pretrain(cfg, step)
    return {"code": code, "reports": reports, "lines": lines.lines}


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_straggler_report_names_the_slow_rank_within_two_intervals() -> None:
    """Rank 1's forward pass sleeps in every step: by the second report (iteration
    ``2 * logger.log_interval``) every rank's report names rank 1 the slowest, and rank 0
    logs it."""
    results = run_distributed(_straggler_rank, 2, find_free_port(), timeout=150)
    second = 2 * REPORT_INTERVAL
    for rank, result in enumerate(results):
        assert result["code"] == 0
        assert sorted(result["reports"]) == [REPORT_INTERVAL, second], result["reports"]
        slowest, slowest_ms = result["reports"][second]
        assert slowest == 1, (rank, result["reports"])
        # Rank 1 slept in each timed forward pass of the interval (one per iteration).
        assert slowest_ms >= STRAGGLER_SLEEP_S * 1000, result["reports"]
    report_lines = [line for line in results[0]["lines"] if "MxRtt/Rnk:" in line]
    assert len(report_lines) == 2, results[0]["lines"]
    assert re.search(r"MxRtt/Rnk: [\d.]+ms/1 ", report_lines[1]), report_lines[1]
    assert not [line for line in results[1]["lines"] if "MxRtt/Rnk:" in line]  # rank 0 logs


# --------------------------------------------------------------------------- 6. kill mid-save

SAVE_INTERVAL = 10
KILLED_SAVE = 20


def _kill_mid_save_rank(rank: int, world: int, save: str, metrics: str, kill: bool) -> Any:
    captured: dict[str, Any] = {}
    if kill and rank == 0:
        from megatron.core import dist_checkpointing

        write = dist_checkpointing.save

        def write_then_die(sharded_state_dict: Any, checkpoint_dir: Any, *a: Any, **k: Any) -> Any:
            result = write(sharded_state_dict, checkpoint_dir, *a, **k)
            if Path(checkpoint_dir).name == f"iter_{KILLED_SAVE:07d}.tmp":
                # Every shard is written, the checkpoint is not committed yet (no completion
                # marker, not renamed, tracker unchanged): the rank dies, as on a lost node.
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        dist_checkpointing.save = write_then_die

    def step(state: Any, data_iterator: Any, model: Any) -> Any:
        captured["loaded"] = state.loaded_iteration
        return forward_step(state, data_iterator, model)

    overrides = [
        *DRILL_OVERRIDES,
        f"checkpoint.save={save}",
        f"checkpoint.save_interval={SAVE_INTERVAL}",
    ]
    code = pretrain(load_config(recipe_path("tiny_gpt"), overrides), step, metrics_file=metrics)
    return {"code": code, "loaded": captured["loaded"]}


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_during_a_checkpoint_save_resumes_from_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    """Rank 0 is SIGKILLed in the middle of saving iteration 20 (shards written, not
    committed): the tracker still names 10, the relaunch loads 10 (never the half-written
    directory), and its losses equal the reference."""
    reference = reference_losses()
    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    # Rank 0 dies (-9); rank 1, waiting for it to commit, may report the lost peer first.
    with pytest.raises(DistributedTestError, match=r"exit codes \{0: -9\}|rank 1 failed"):
        run_distributed(_kill_mid_save_rank, 2, str(save), str(metrics), True, timeout=400)
    previous = KILLED_SAVE - SAVE_INTERVAL
    half_written = save / f"iter_{KILLED_SAVE:07d}.tmp"
    assert tracker_iteration(save) == previous
    assert sorted(p.name for p in half_written.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not (half_written / "checkpoint_complete.json").exists()
    assert not (save / f"iter_{KILLED_SAVE:07d}").exists()
    killed = loss_records(metrics)  # at least up to the checkpoint of 10 (flushed with it)
    assert [step for step, _ in killed] == list(range(1, len(killed) + 1))
    assert previous <= len(killed) <= KILLED_SAVE

    results = run_distributed(_kill_mid_save_rank, 2, str(save), str(metrics), False, timeout=400)
    assert results == [{"code": 0, "loaded": previous}] * 2
    resumed = loss_records(metrics)[len(killed) :]
    assert [step for step, _ in resumed] == list(range(previous + 1, TRAIN_ITERS + 1))
    assert_losses_match(killed + resumed, reference)
    assert tracker_iteration(save) == TRAIN_ITERS
    assert not half_written.exists()  # the next save cleared the leftover
    assert (save / f"iter_{KILLED_SAVE:07d}" / "checkpoint_complete.json").exists()
