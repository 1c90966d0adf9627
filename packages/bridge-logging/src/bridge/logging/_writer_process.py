"""The training process's side of the metric writer process (``metrics_writer_mode="process"``).

The W&B, MLflow and Comet clients do their I/O while holding the GIL (MLflow's file store
lists directories per value, Comet offline writes and flushes per value, W&B waits on a
thread per call), so a background thread would still slow a CPU-bound step. They run in a
separate process instead, which the training process feeds through a pipe: one pickled
``(step, {tag: float})`` record per ``log_metrics`` call.

How the process is started: ``subprocess.Popen([sys.executable, "-c", ...])`` with two
pipes passed as file descriptors. Not ``fork`` (the training process has threads and
possibly CUDA by then), and not multiprocessing's ``spawn`` / ``forkserver``, which
re-import the main script in the child: a training script without an
``if __name__ == "__main__"`` guard would start training again there. The child imports
only the backend modules (no torch).

Guarantees:

* order: one pipe, read by one loop, so every backend sees its calls in the order made;
* :meth:`WriterProcess.flush` returns once everything sent before it is written and
  flushed;
* latency: records reach the backends within ``LINGER_S`` (0.5 s) of being sent, or at
  the next flush. The writer process sleeps on a timer, not on the command pipe, so a
  record costs the training process a pipe write without waking anything; a flush or a
  close writes a byte to a third pipe that wakes it at once;
* bounded: the pipe holds 1 MiB (several hundred steps of metrics); when the writer
  process falls that far behind, the training process blocks in the send until it catches
  up; nothing is dropped;
* errors: a setup error (missing package, bad tracking URI, no API key) is raised by the
  constructor with the backend's message; a later backend error is raised by the next
  send / flush (once per error); a dead writer process is raised by every later call;
* :meth:`WriterProcess.close` drains, closes the backends and joins; it is idempotent,
  never raises and also runs at interpreter exit for writers that were never closed. If
  the training process dies without closing, the writer process sees the pipe close and
  closes the backends itself.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import pickle
import select
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from bridge.logging.backends import BackendNotInstalledError, is_tensor

logger = logging.getLogger("bridge.logging")

PIPE_BYTES = 1 << 20
"""Capacity asked for the command pipe (Linux' default ceiling for unprivileged users)."""

STARTUP_TIMEOUT_S = 900.0
"""How long building the backends in the writer process may take (W&B online retries)."""

CLOSE_TIMEOUT_S = 600.0
"""How long closing may take (Comet and W&B upload what is left when online)."""

_BOOTSTRAP = """\
import sys, types
sys.path[:] = {path!r}
import bridge
package = types.ModuleType("bridge.logging")
package.__path__ = [{package_dir!r}]
sys.modules["bridge.logging"] = bridge.logging = package
from bridge.logging._writer_child import main
main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
"""

# Exception types a setup error keeps when it is raised again in the training process.
_KNOWN_ERRORS: dict[str, type[Exception]] = {
    "BackendNotInstalledError": BackendNotInstalledError,
    "ValueError": ValueError,
    "TypeError": TypeError,
    "RuntimeError": RuntimeError,
    "FileNotFoundError": FileNotFoundError,
    "PermissionError": PermissionError,
    "OSError": OSError,
}

_live: weakref.WeakSet[WriterProcess] = weakref.WeakSet()
_atexit_registered = False


def _close_live_processes() -> None:
    for process in list(_live):
        process.close()


def plain(value: Any) -> Any:
    """``value`` with tensors and numpy scalars turned into Python numbers / lists.

    What crosses the pipe must be picklable without torch in the writer process.
    """
    if is_tensor(value):
        return value.detach().reshape(()).item() if value.numel() == 1 else value.tolist()
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value) if type(value) in (list, tuple) else value
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        return value.item() if getattr(value, "size", 1) == 1 else value.tolist()
    return value


class WriterProcess:
    """A process that owns some metric writers and writes what the training process sends.

    Args:
        writers: ``(kind, factory, kwargs)`` per writer, in order: ``kind`` names the
            writer in :meth:`send_metrics` and :meth:`call`; ``factory`` is
            ``"package.module:Class"`` (a :class:`bridge.logging.MetricWriter` subclass
            importable in the writer process without torch), built there as
            ``Class(**kwargs)``; ``kwargs`` must be picklable plain data.
        startup_timeout: Seconds the writers may take to build.
        wait: Wait here until the writers are built. With ``False`` the process builds
            them while the caller goes on; :meth:`wait_ready` (called by every other
            method) then waits and raises the setup error.

    Raises:
        TypeError: ``kwargs`` cannot be sent to another process.
        BackendNotInstalledError, ValueError, RuntimeError, OSError: Building a writer
            failed in the writer process (the message is the writer's own); other
            exception types arrive as ``RuntimeError`` naming the type.
    """

    def __init__(
        self,
        writers: Sequence[tuple[str, str, Mapping[str, Any]]],
        *,
        startup_timeout: float = STARTUP_TIMEOUT_S,
        wait: bool = True,
    ) -> None:
        spec = [(kind, factory, dict(kwargs)) for kind, factory, kwargs in writers]
        self.kinds: tuple[str, ...] = tuple(kind for kind, _, _ in spec)
        if len(set(self.kinds)) != len(self.kinds):
            raise ValueError(f"writer kinds must be distinct, got {self.kinds}")
        try:
            payload = pickle.dumps(("spec", spec))
        except Exception as exc:
            raise TypeError(
                f"the metric writer settings cannot be sent to the writer process ({exc}); "
                "pass plain data (the run config as a dict of numbers, strings, lists), or "
                "set LoggerConfig.metrics_writer_mode='inline'"
            ) from exc
        self._pid = os.getpid()
        self._closed = False
        self._dead_message: str | None = None
        self._errors: list[str] = []
        self._tokens = itertools.count(1)
        self._open_kinds: set[str] = set(self.kinds)
        self.info: dict[str, dict[str, Any]] = {}
        self._ready = False
        self._startup_deadline = time.monotonic() + startup_timeout
        # The pipes carry whole messages only if one thread at a time uses them (a
        # MetricWriters with asynchronous=True sends from its thread, proxies from the
        # caller's).
        self._lock = threading.RLock()

        command_read, command_write = os.pipe()
        answer_read, answer_write = os.pipe()
        wake_read, wake_write = os.pipe()
        # A wake-up that finds the pipe full is redundant: one is already pending.
        os.set_blocking(wake_write, False)
        with contextlib.suppress(OSError, AttributeError):  # Linux only; the default works
            import fcntl

            fcntl.fcntl(command_write, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        code = _BOOTSTRAP.format(path=list(sys.path), package_dir=str(Path(__file__).parent))
        try:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    code,
                    str(command_read),
                    str(answer_write),
                    str(wake_read),
                ],
                pass_fds=(command_read, answer_write, wake_read),
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        except BaseException:
            for fd in (command_read, command_write, answer_read, answer_write):
                os.close(fd)
            os.close(wake_read)
            os.close(wake_write)
            raise
        # Only the writer process keeps these ends: its exit closes the answer pipe (our
        # recv sees EOF) and our exit closes the command pipe (its recv sees EOF).
        os.close(command_read)
        os.close(answer_write)
        os.close(wake_read)
        self._wake_fd: int | None = wake_write
        self._out = Connection(command_write, readable=False)
        self._in = Connection(answer_read, writable=False)
        # One registered poll object: checking for answers on every send is then a single
        # syscall (Connection.poll builds a selector per call).
        self._answers = select.poll()
        self._answers.register(answer_read, select.POLLIN)
        global _atexit_registered
        if not _atexit_registered:
            atexit.register(_close_live_processes)
            _atexit_registered = True
        _live.add(self)
        try:
            self._out.send_bytes(payload)
        except BaseException:
            self._abandon()
            raise
        if wait:
            self.wait_ready()

    # ---------------------------------------------------------------- startup

    def wait_ready(self) -> None:
        """Wait until the writers are built (a no-op afterwards).

        Raises:
            BackendNotInstalledError, ValueError, RuntimeError, OSError: Building a writer
                failed (the process is then ended and this object closed).
        """
        with self._lock:
            if self._ready or self._closed:
                return
            try:
                self._await_ready()
            except BaseException:
                self._abandon()
                raise
            self._ready = True

    def _await_ready(self) -> None:
        while True:
            remaining = self._startup_deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(
                    f"the metric writer process (pid {self.pid}) did not build its writers "
                    "in time; see its output above"
                )
            try:
                if not self._in.poll(min(remaining, 1.0)):
                    continue
                message = self._in.recv()
            except EOFError:
                raise RuntimeError(
                    f"the metric writer process (pid {self.pid}) exited with code "
                    f"{self._exit_code()} while building its writers; see its output above"
                ) from None
            if message[0] == "ready":
                self.info = dict(zip(self.kinds, message[1], strict=True))
                return
            if message[0] == "failed":
                _, type_name, text = message
                error_type = _KNOWN_ERRORS.get(type_name)
                if error_type is None:
                    raise RuntimeError(f"{type_name}: {text} (in the metric writer process)")
                raise error_type(text)
            self._handle(message)

    # ---------------------------------------------------------------- state

    @property
    def pid(self) -> int:
        """The writer process's id."""
        return int(self._proc.pid)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed

    def _exit_code(self) -> int | None:
        try:
            return self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None

    def _died(self) -> None:
        if self._dead_message is None:
            code = self._exit_code()
            kinds = ", ".join(self.kinds)
            how = (
                f"was killed by signal {-code}"
                if code is not None and code < 0
                else (f"exited with code {code}" if code is not None else "stopped answering")
            )
            self._dead_message = (
                f"the metric writer process (pid {self.pid}) {how}; its writers ({kinds}) "
                "receive no more metrics and those sent since the last flush may be lost (its "
                "error output, "
                "if any, is above). Build new writers to log again, or set "
                "LoggerConfig.metrics_writer_mode='inline'"
            )
        raise RuntimeError(self._dead_message)

    def _check_usable(self) -> None:
        if not self._ready:
            self.wait_ready()
        if self._closed:
            raise RuntimeError("the metric writer process is closed; build new writers")
        if self._dead_message is not None:
            raise RuntimeError(self._dead_message)
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"these metric writers belong to process {self._pid}; a forked process "
                "cannot write through them"
            )

    # ---------------------------------------------------------------- answers

    def _handle(self, message: tuple[Any, ...]) -> None:
        tag = message[0]
        if tag == "log":
            logger.log(message[1], message[2])
        elif tag == "error":
            self._errors.append(
                f"the {message[1]} metric writer failed in the writer process while {message[2]}"
            )

    def _read_answers(self) -> None:
        """Handle every answer already waiting (does not block)."""
        try:
            while self._answers.poll(0):
                self._handle(self._in.recv())
        except EOFError:
            self._died()

    def _raise_errors(self) -> None:
        if self._errors:
            errors, self._errors = self._errors, []
            raise RuntimeError("; ".join(errors))

    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            self._out.send(message)
        except (BrokenPipeError, ConnectionResetError):
            self._died()

    def _wake(self) -> None:
        """Have the writer process handle what was sent now instead of within LINGER_S."""
        if self._wake_fd is None:
            return
        # Full: a wake-up is already pending. Broken: the process is gone, which the
        # command pipe reports.
        with contextlib.suppress(BlockingIOError, BrokenPipeError, OSError):
            os.write(self._wake_fd, b"w")

    def _close_pipes(self) -> None:
        for conn in (self._out, self._in):
            with contextlib.suppress(OSError):
                conn.close()
        if self._wake_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._wake_fd)
            self._wake_fd = None

    # ---------------------------------------------------------------- commands

    def send_metrics(
        self, values: Mapping[str, float], step: int, kinds: tuple[str, ...] | None = None
    ) -> None:
        """Queue ``values`` (Python floats) at ``step`` for the ``kinds`` writers (all: None).

        Blocks only while the pipe is full (the writer process is far behind).

        Raises:
            RuntimeError: The writer process died or is closed, or a writer reported an
                error since the last call.
        """
        with self._lock:
            self._check_usable()
            self._read_answers()
            self._send(("m", step, values, kinds))
            self._raise_errors()

    def send_records(
        self, records: Sequence[tuple[Mapping[str, float], int, tuple[str, ...] | None]]
    ) -> None:
        """Queue several ``(values, step, kinds)`` records, in order, in one message.

        Raises:
            RuntimeError: As :meth:`send_metrics`.
        """
        if len(records) == 1:
            values, step, kinds = records[0]
            self.send_metrics(values, step, kinds)
            return
        with self._lock:
            self._check_usable()
            self._read_answers()
            self._send(("M", [("m", step, values, kinds) for values, step, kinds in records]))
            self._raise_errors()

    def send_table(
        self,
        kinds: tuple[str, ...] | None,
        tag: str,
        columns: Sequence[str],
        rows: Sequence[Sequence[str]],
        step: int,
    ) -> None:
        """Queue a table of strings for the ``kinds`` writers (all: None), in order with
        the records (see ``MetricWriter.log_table``).

        Raises:
            RuntimeError: As :meth:`send_metrics`.
        """
        message = ("t", kinds, tag, [str(c) for c in columns], [[str(c) for c in r] for r in rows])
        with self._lock:
            self._check_usable()
            self._read_answers()
            self._send((*message, int(step)))
            self._raise_errors()

    def call(self, kind: str, method: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Queue ``<kind backend>.<method>(*args, **kwargs)``, to run in the writer process.

        Raises:
            TypeError: An argument cannot be sent to another process.
            RuntimeError: As :meth:`send_metrics`.
        """
        message = ("c", kind, method, plain(tuple(args)), plain(dict(kwargs)))
        try:
            payload = pickle.dumps(message)
        except Exception as exc:
            raise TypeError(
                f"{kind}.{method}(): an argument cannot be sent to the metric writer process "
                f"({exc}); pass numbers, strings, lists and dicts, or set "
                "LoggerConfig.metrics_writer_mode='inline' to call the backend directly"
            ) from exc
        with self._lock:
            self._check_usable()
            self._read_answers()
            try:
                self._out.send_bytes(payload)
            except (BrokenPipeError, ConnectionResetError):
                self._died()
            self._raise_errors()

    def flush(self) -> None:
        """Wait until everything sent so far is written and every writer flushed.

        Raises:
            RuntimeError: As :meth:`send_metrics` (including errors of the flush itself).
        """
        with self._lock:
            if self._closed:
                return
            self._check_usable()
            token = next(self._tokens)
            self._send(("f", token))
            self._wake()
            try:
                while True:
                    message = self._in.recv()
                    if message[0] == "flushed" and message[1] == token:
                        break
                    self._handle(message)
            except EOFError:
                self._died()
            self._raise_errors()

    def release(self, kind: str) -> None:
        """Mark the ``kind`` writer closed; close the process once every writer is."""
        self._open_kinds.discard(kind)
        if not self._open_kinds:
            self.close()

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Write what is queued, close every writer and end the process.

        Idempotent and never raises: errors (of the writers, or a dead or hung process)
        are logged at ERROR level. A process that does not finish within ``timeout``
        seconds is killed.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            _live.discard(self)
            if os.getpid() != self._pid:  # a forked copy: the owner closes the process
                return
            try:
                self._close(timeout)
            except Exception:
                logger.exception("closing the metric writer process failed")
            finally:
                self._close_pipes()

    def _close(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        if self._dead_message is None:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self._out.send(("x",))
            self._wake()
            try:
                while (remaining := deadline - time.monotonic()) > 0:
                    if not self._in.poll(min(remaining, 1.0)):
                        continue
                    message = self._in.recv()
                    if message[0] == "closed":
                        for error in message[1]:
                            logger.error("metric writer process: %s", error)
                        break
                    self._handle(message)
            except EOFError:
                pass
        for error in self._errors:
            logger.error("%s", error)
        self._errors = []
        try:
            code = self._proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            logger.error(
                "the metric writer process (pid %d) did not finish within %.0f s of close(); "
                "killing it (metrics not yet written are lost)",
                self.pid,
                timeout,
            )
            self._proc.kill()
            code = self._proc.wait()
        if self._dead_message is not None:
            logger.error("%s", self._dead_message)
        elif code != 0:
            logger.error("the metric writer process (pid %d) exited with code %s", self.pid, code)

    def _abandon(self) -> None:
        """After a failed start: end the process without waiting for writers."""
        self._closed = True
        _live.discard(self)
        self._close_pipes()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("dead" if self._dead_message else "running")
        return f"WriterProcess(pid={self.pid}, {', '.join(self.kinds)}, {state})"
