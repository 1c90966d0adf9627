"""Run code on several torch.distributed ranks (gloo on CPU) with a hard timeout.

Distributed code hangs rather than fails when ranks disagree (a missing collective, a
mismatched send/recv), and gloo's default timeout is 30 minutes. Everything here kills
every rank and raises once ``timeout`` seconds have passed, reporting what each rank
printed or raised, so a hang becomes a failing test instead of a stalled CI job.

Two launchers:

* :func:`run_distributed` forks ``world_size`` processes from the current one and runs a
  Python callable on each (no import of the callable by name is needed, so it works for
  functions defined in test modules).
* :func:`run_torchrun` launches a script under ``torchrun`` in a subprocess, the way users
  launch training, and returns its completed process.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import multiprocessing as mp
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = [
    "DistributedTestError",
    "find_free_port",
    "ignored_signals",
    "run_distributed",
    "run_torchrun",
]


# A real-time signal no application code here uses (SIGUSR1/2 may be a training exit signal).
_STACK_DUMP_SIGNAL = signal.SIGRTMIN + 3


class DistributedTestError(RuntimeError):
    """A rank raised, died, or did not finish within the timeout."""


def ignored_signals(pid: int) -> set[signal.Signals]:
    """The signals process ``pid`` ignores (``SIG_IGN``), from ``/proc/<pid>/status`` (Linux).

    For tests of helper processes that must outlive the signals a launcher sends to every
    process of a job (srun signals a whole SLURM step).

    Raises:
        FileNotFoundError: No such process (or no ``/proc``).
    """
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            mask = int(line.split()[1], 16)
            return {sig for sig in signal.Signals if 0 < sig <= 64 and mask >> (sig - 1) & 1}
    return set()


def find_free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: Mapping[str, str],
    pg_timeout_s: float,
    results: Any,
) -> None:
    import torch
    import torch.distributed as dist

    # Objects inherited from the parent are never collected here: the parent's garbage may
    # hold process groups, stores or threads' handles whose destructors wait for threads a
    # forked child does not have (a rank then hangs or crashes in the collector).
    gc.freeze()
    # Own process group, so the parent can kill this rank together with any process it
    # started (a Manager, DataLoader workers) instead of orphaning them.
    os.setpgid(0, 0)
    # On a timeout the parent sends _STACK_DUMP_SIGNAL: every thread's stack goes to
    # stderr, so a hang shows where each rank was stuck.
    faulthandler.register(_STACK_DUMP_SIGNAL, all_threads=True)
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    # One intra-op thread per rank: the ranks share the machine's cores, and a forked
    # child must not reuse the parent's OpenMP pool.
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        try:
            payload = pickle.dumps(value)
        except Exception as exc:  # report unpicklable results instead of hiding them
            results.put((rank, False, f"result of rank {rank} is not picklable: {exc!r}"))
            return
        results.put((rank, True, payload))
    except BaseException:  # every failure is reported to the parent
        results.put((rank, False, traceback.format_exc()))


def _dump_stacks(procs: Sequence[Any]) -> None:
    """Ask hung ranks to print every thread's stack (see ``faulthandler`` in the worker)."""
    for proc in procs:
        if proc.pid is not None and proc.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, _STACK_DUMP_SIGNAL)
            time.sleep(0.5)  # one rank at a time, so the dumps do not interleave


def _kill_process_group(pid: int | None) -> None:
    """SIGKILL the process group led by a rank: the rank and whatever it left running."""
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked ranks.

    Each rank gets an initialised default process group (``backend``, gloo unless told
    otherwise) that is destroyed after ``fn`` returns.

    Args:
        fn: Callable run on every rank; its return value must be picklable.
        world_size: Number of ranks.
        *args: Extra positional arguments passed to ``fn`` on every rank.
        timeout: Seconds after which every rank is killed and the call fails.
        backend: torch.distributed backend.
        env: Extra environment variables set in every rank before the group is built.

    Returns:
        The return values of ``fn``, indexed by rank.

    Raises:
        DistributedTestError: A rank raised (its traceback is included), exited without
            a result, or the ranks did not all finish within ``timeout`` seconds.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    # Destroy the parent's garbage (earlier in-process runs' process groups and stores) here,
    # where their destructors can run, instead of leaving it to the forked ranks.
    gc.collect()
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = find_free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, backend, fn, args, dict(env or {}), timeout, results),
            # Not daemonic: ranks may start children of their own (DataLoader workers,
            # dist_checkpointing's Manager), which daemonic processes may not. The
            # ``finally`` below kills every rank that is still alive.
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
        # Also set from the parent, so a kill right after start finds the group.
        if proc.pid is not None:
            with contextlib.suppress(OSError):
                os.setpgid(proc.pid, proc.pid)

    outcome: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcome) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outcome))
                _dump_stacks([procs[r] for r in missing])
                raise DistributedTestError(
                    f"ranks {missing} did not finish within {timeout:.0f} s (hang?); "
                    f"finished: {sorted(outcome)}; their stacks were written to stderr"
                )
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 0.5))
            except Exception:  # queue.Empty: check for ranks that died silently
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if r not in outcome and p.exitcode is not None and results.empty()
                ]
                if dead:
                    codes = {r: procs[r].exitcode for r in dead}
                    raise DistributedTestError(
                        f"ranks {dead} exited without a result (exit codes {codes})"
                    ) from None
                continue
            outcome[rank] = (ok, payload)
            if not ok:
                raise DistributedTestError(f"rank {rank} failed:\n{payload}")
    finally:
        for proc in procs:
            _kill_process_group(proc.pid)
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=10)
        results.close()
    return [pickle.loads(outcome[rank][1]) for rank in range(world_size)]


def run_torchrun(
    script: str | os.PathLike[str],
    nproc_per_node: int,
    script_args: Sequence[str] = (),
    *,
    timeout: float = 300.0,
    torchrun_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Launch ``script`` under ``torchrun`` on this machine and wait for it.

    Args:
        script: Python file to run on every rank.
        nproc_per_node: Number of ranks.
        script_args: Arguments passed to the script.
        timeout: Seconds after which the whole launch (all ranks) is killed.
        torchrun_args: Extra torchrun options (``--max-restarts=2``, ...).
        env: Variables added to the environment.
        cwd: Working directory.
        check: Raise when torchrun exits non-zero.

    Returns:
        The completed process, with stdout and stderr captured as text.

    Raises:
        DistributedTestError: The launch timed out, or failed while ``check`` is set.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc_per_node}",
        "--master-addr=127.0.0.1",
        f"--master-port={find_free_port()}",
        *torchrun_args,
        str(Path(script)),
        *script_args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    # A new session lets a timeout kill torchrun together with every rank it started.
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        raise DistributedTestError(
            f"torchrun {script} did not finish within {timeout:.0f} s\n"
            f"--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-4000:]}"
        ) from None
    completed = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and proc.returncode != 0:
        raise DistributedTestError(
            f"torchrun {script} exited with {proc.returncode}\n"
            f"--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-6000:]}"
        )
    return completed
