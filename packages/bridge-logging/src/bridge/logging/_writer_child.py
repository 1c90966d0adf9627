"""The metric writer process: runs the W&B / MLflow / Comet writers for the training process.

Started by :class:`bridge.logging._writer_process.WriterProcess` as
``python -c <bootstrap> <read fd> <write fd> <wake fd>``. The bootstrap registers ``bridge.logging`` as
a bare package, so this module and :mod:`bridge.logging.backends` load without the
package's ``__init__`` (which imports torch): the process starts in the time its backend
libraries take to import.

It reads commands from the training process and answers on a second pipe. It sleeps on a
third, the wake-up pipe, for at most :data:`LINGER_S`, then handles every command waiting
in the command pipe, in order; the training process writes to the wake-up pipe after a
flush or a close, so those are handled at once, while records (sent every step) never wake
it.


* ``("spec", [(kind, factory, kwargs), ...])`` first: build the writers, answer
  ``("ready", [info, ...])`` or ``("failed", exception type, message)``;
* ``("m", step, {tag: float}, kinds)``: write a record (``kinds`` ``None``: every writer);
  ``("M", [("m", ...), ...])``: several records sent together; records waiting together
  are handed to each writer in one ``log_records`` call;
* ``("c", kind, method, args, kwargs)``: a call made on a backend proxy;
* ``("t", kinds, tag, columns, rows, step)``: a table of text for the ``kinds`` writers
  (``MetricWriter.log_table``);
* ``("f", token)``: flush every writer, answer ``("flushed", token)``;
* ``("x",)``: close every writer, answer ``("closed", [errors])`` and exit.

A writer that fails is reported as ``("error", kind, message)`` once per flush interval
(the traceback goes to stderr) and keeps receiving records. Log records of the
``bridge.logging`` logger go back as ``("log", level, message)``. SIGINT and SIGTERM are
ignored: when the training process ends, however it ends, its ends of the pipes close, and
this process then closes the writers (so runs are finished and archives written) and exits.
It runs at a lower CPU priority (nice +10) than the training process, and so do the
processes its backends start.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import select
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from bridge.logging.backends import MetricWriter

# Records handed to the writers in one call at most (bounded so that a flush or a close
# queued behind a long backlog still comes soon).
_MAX_BATCH = 256

LINGER_S = 0.5
"""How long records wait in the pipe before this process wakes up to write them.

Waking a process that sleeps on a pipe costs the writing side a wake-up on every write
(about 0.1 ms of CPU per step on a virtual machine, where it is an inter-processor
interrupt); a process that sleeps on a timer instead costs it nothing, and the backends
get several steps per call (MLflow stores them in one request). A flush or a close wakes it
at once."""

_PREFIX = "[bridge-logging writer process]"

WRITER_NICENESS = 10
"""Added to this process's nice value (lower CPU priority than the training process)."""


class _Outbox:
    """The answer pipe; a vanished training process is not an error here."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def send(self, message: tuple[Any, ...]) -> None:
        # An OSError means the training process is gone; its EOF ends the loop.
        with contextlib.suppress(OSError):
            self._conn.send(message)


class _ForwardLogs(logging.Handler):
    """Sends ``bridge.logging`` records (e.g. Comet's offline notice) to the training process."""

    def __init__(self, outbox: _Outbox) -> None:
        super().__init__(logging.INFO)
        self._outbox = outbox

    def emit(self, record: logging.LogRecord) -> None:
        self._outbox.send(("log", record.levelno, record.getMessage()))


def _factory(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class _Writers:
    """The writers of this process and the errors not yet reported."""

    def __init__(self, writers: list[tuple[str, MetricWriter]], outbox: _Outbox) -> None:
        self.writers = writers
        self.by_kind = dict(writers)
        self._outbox = outbox
        self._reported: set[str] = set()

    def _failed(self, kind: str, what: str) -> None:
        exc = sys.exc_info()[1]
        print(f"{_PREFIX} {what} of the {kind} writer failed:", file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
        if kind not in self._reported:
            self._reported.add(kind)
            self._outbox.send(("error", kind, f"{what}: {type(exc).__name__}: {exc}"))

    def write(self, batch: list[tuple[Any, ...]]) -> None:
        if not batch:
            return
        for kind, writer in self.writers:
            records = [(m[1], m[2]) for m in batch if m[3] is None or kind in m[3]]
            if records:
                try:
                    writer.log_records(records)
                except Exception:
                    self._failed(kind, f"writing step {records[0][0]}")

    def call(self, kind: str, method: str, args: Any, kwargs: Any) -> None:
        try:
            self.by_kind[kind].forward(method, args, kwargs)
        except Exception:
            self._failed(kind, f"{kind}.{method}()")

    def table(self, kinds: Any, tag: str, columns: Any, rows: Any, step: int) -> None:
        for kind, writer in self.writers:
            if kinds is None or kind in kinds:
                try:
                    writer.log_table(tag, columns, rows, step)
                except Exception:
                    self._failed(kind, f"writing table {tag!r} of step {step}")

    def flush(self) -> None:
        for kind, writer in self.writers:
            try:
                writer.flush()
            except Exception:
                self._failed(kind, "flushing")
        self._reported.clear()

    def close(self) -> list[str]:
        errors = []
        for kind, writer in self.writers:
            try:
                writer.close()
            except Exception as exc:
                print(f"{_PREFIX} closing the {kind} writer failed:", file=sys.stderr)
                traceback.print_exc(file=sys.stderr)
                errors.append(f"closing the {kind} writer: {type(exc).__name__}: {exc}")
        return errors


def _build(spec: list[tuple[str, str, dict[str, Any]]]) -> list[tuple[str, MetricWriter]]:
    writers: list[tuple[str, MetricWriter]] = []
    try:
        for kind, path, kwargs in spec:
            writers.append((kind, _factory(path)(**kwargs)))
    except BaseException:
        for _, writer in writers:  # do not leave half a set of runs open
            try:
                writer.close()
            except Exception:
                traceback.print_exc(file=sys.stderr)
        raise
    return writers


class _WakeUps:
    """The wake-up pipe: the training process writes a byte to it after a command that
    must not wait (flush, close); records alone never wake this process."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._open = True

    def wait(self, timeout: float) -> None:
        """Return when woken, or after ``timeout`` seconds."""
        if not self._open:
            time.sleep(timeout)
            return
        ready, _, _ = select.select([self._fd], [], [], timeout)
        if ready and not os.read(self._fd, 4096):  # drains pending wake-ups
            # The training process closed its end (it ended; the command pipe tells how).
            self._open = False


def _serve(inbox: Connection, wake: _WakeUps, outbox: _Outbox, writers: _Writers) -> None:
    incoming = select.poll()
    incoming.register(inbox.fileno(), select.POLLIN)
    while True:
        wake.wait(LINGER_S)
        batch: list[tuple[Any, ...]] = []
        while incoming.poll(0):
            try:
                message = inbox.recv()
            except EOFError:
                writers.write(batch)
                print(
                    f"{_PREFIX} the training process ended without closing its metric "
                    "writers; closing them",
                    file=sys.stderr,
                )
                writers.close()
                return
            tag = message[0]
            if tag in ("m", "M"):
                if tag == "m":
                    batch.append(message)
                else:
                    batch.extend(message[1])
                if len(batch) >= _MAX_BATCH:
                    writers.write(batch)
                    batch = []
                continue
            # Records sent before a command are written before it runs.
            writers.write(batch)
            batch = []
            if tag == "c":
                writers.call(*message[1:])
            elif tag == "t":
                writers.table(*message[1:])
            elif tag == "f":
                writers.flush()
                outbox.send(("flushed", message[1]))
            elif tag == "x":
                outbox.send(("closed", writers.close()))
                return
        writers.write(batch)


def main(read_fd: int, write_fd: int, wake_fd: int) -> None:
    """Build the writers the training process asks for and serve its commands until closed."""
    # The training process decides when logging ends (see the module docstring). That
    # includes the signals a scheduler stops a job with: srun delivers them to every
    # process of a SLURM step, this one too (SIGUSR1/2 for a time limit, by convention).
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    # comet_ml hooks libraries imported after it (MLflow runs would become extra Comet
    # experiments); here every value comes from the writers.
    os.environ.setdefault("COMET_DISABLE_AUTO_LOGGING", "1")
    # Logging yields to training when every core is busy: at a lower priority this process
    # (and the helpers the backends start, such as W&B's service process, which inherit
    # it) does not preempt the training process when a record wakes it; it catches up in
    # idle time, and the bounded pipe stops the training process only if it falls far
    # behind. On a machine with an idle core it changes nothing.
    with contextlib.suppress(OSError):
        os.nice(WRITER_NICENESS)
    inbox = Connection(read_fd, writable=False)
    outbox = _Outbox(Connection(write_fd, readable=False))
    log = logging.getLogger("bridge.logging")
    log.addHandler(_ForwardLogs(outbox))
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        tag, spec = inbox.recv()
    except EOFError:
        return
    assert tag == "spec", tag
    try:
        built = _build(spec)
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        outbox.send(("failed", type(exc).__name__, str(exc)))
        sys.exit(1)
    outbox.send(("ready", [writer.info for _, writer in built]))
    _serve(inbox, _WakeUps(wake_fd), outbox, _Writers(built, outbox))
