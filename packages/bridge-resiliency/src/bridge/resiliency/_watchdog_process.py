"""The watchdog process of :class:`bridge.resiliency.HangWatchdog` (stdlib only).

Run as ``python -I -S _watchdog_process.py <target pid> <rank> <signal number>`` with a pipe
on stdin. It must not import torch or bridge: it starts in milliseconds and keeps running
while the rank it watches is stopped (a hung process cannot watch itself, so the watchdog
is a separate process).

Protocol, one line per message on stdin:

* ``ARM <seconds> <phase>``: the rank must send its next message within ``seconds``.
* ``DISARM``: no deadline until the next ``ARM``.
* ``STOP``: exit.

When a deadline passes, the watchdog writes a line to stderr naming the rank, the phase, the
timeout and the wall-clock time (``at unix time <seconds>``, so logs can be matched against
other events), sends the signal to the rank and exits. It also exits when stdin closes (the
rank exited or died) or when the rank is no longer its parent.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

_POLL_SECONDS = 0.5


def _watch(target_pid: int, rank: int, kill_signal: int) -> int:
    stdin = sys.stdin.fileno()
    deadline: float | None = None
    timeout = 0.0
    phase = ""
    pending = b""
    while True:
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            sys.stderr.write(
                f"bridge.resiliency.HangWatchdog: rank {rank} (pid {target_pid}) made no "
                f"progress for {timeout:.1f} s in phase {phase!r}; sending "
                f"{signal.Signals(kill_signal).name} so the launcher can restart the job "
                f"(at unix time {time.time():.3f})\n"
            )
            sys.stderr.flush()
            try:
                os.kill(target_pid, kill_signal)
            except ProcessLookupError:
                return 0
            return 0
        if os.getppid() != target_pid:
            return 0
        wait = _POLL_SECONDS if deadline is None else min(_POLL_SECONDS, deadline - now)
        ready, _, _ = select.select([stdin], [], [], max(wait, 0.0))
        if not ready:
            continue
        chunk = os.read(stdin, 65536)
        if not chunk:
            return 0
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for raw in lines:
            parts = raw.decode().split(maxsplit=2)
            if not parts:
                continue
            if parts[0] == "STOP":
                return 0
            if parts[0] == "DISARM":
                deadline = None
            elif parts[0] == "ARM" and len(parts) >= 2:
                timeout = float(parts[1])
                phase = parts[2] if len(parts) > 2 else ""
                deadline = time.monotonic() + timeout


def main(argv: list[str]) -> int:
    """Watch the rank named on the command line until told to stop."""
    target_pid, rank, kill_signal = (int(arg) for arg in argv[1:4])
    # torchrun stops a worker by signalling its whole process group, watchdog included, and
    # srun signals every process of a SLURM step (SIGUSR1/2 for a time limit, by
    # convention). The watchdog must outlive them (the rank may be saving a checkpoint, or
    # be stopped and still need killing); it leaves when stdin closes or its parent changes.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    return _watch(target_pid, rank, kill_signal)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
