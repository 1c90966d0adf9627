"""A single background thread that runs the metric writers' calls in order."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

_STOP = object()


class WriterThread:
    """Runs submitted calls one after another on a daemon thread.

    Backends then never hold up a training step (W&B hands every ``log`` to another
    thread and waits; MLflow's file store and Comet's offline mode do file I/O per value),
    and their calls keep the order in which they were submitted. A call that raises does
    not stop the thread: the first error is kept and re-raised in the caller by the next
    :meth:`submit` or :meth:`drain`.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(
            target=self._run, name="bridge-logging-writers", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fn, args = item
            try:
                fn(*args)
            except BaseException as exc:  # kept for the caller, the thread goes on
                if self._error is None:
                    self._error = exc

    def raise_pending(self) -> None:
        """Re-raise (once) the first error of a call run on the thread."""
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"a metric writer failed in the background: {error!r}") from error

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)``; first re-raise any earlier background error."""
        self.raise_pending()
        self._queue.put((fn, args))

    def drain(self) -> None:
        """Wait until every call queued so far has run, then re-raise its first error."""
        if not self._stopped:
            done = threading.Event()
            self._queue.put((done.set, ()))
            done.wait()
        self.raise_pending()

    def stop(self) -> None:
        """Run what is queued, then end the thread. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._queue.put(_STOP)
        self._thread.join()
