"""Checks of the launch itself, run by ``bridge-train`` before anything is built.

* :func:`shared_store_restart_notice`: torchrun on several nodes with restarts and the
  rendezvous store shared by all rounds (torch's default) cannot take a replacement node;
  the command says so, once, before training.
* :func:`check_output_file` / :func:`check_writable_directory`: every file or directory
  the run will write (``--metrics-file``; the config's directories, through the rules of
  :mod:`bridge.train.checks.rules`) must be writable, so a typo or a read-only mount fails
  at start, not after the first hour of training.
* :func:`interrupt_handlers`: Ctrl-C and SIGTERM end the run as an exception the command
  reports in one line; signals that follow while the run closes do not interrupt the
  closing (a second Ctrl-C exits at once).

Nothing here imports torch.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from bridge.config import ConfigError

__all__ = [
    "Terminated",
    "check_output_file",
    "check_writable_directory",
    "interrupt_handlers",
    "shared_store_restart_notice",
]


def shared_store_restart_notice(environ: Mapping[str, str]) -> str | None:
    """The warning for a torchrun launch on several nodes whose lost node cannot be replaced.

    With ``--max-restarts`` and torch's default of one rendezvous store shared by every
    round (``TORCHELASTIC_USE_AGENT_STORE=True``), a node that joins in a later round (a
    replacement for a lost one, or a node returning to an elastic ``--nnodes=MIN:MAX`` job)
    waits for the store's address, which node 0's agent publishes in the first round only:
    the agents fail after 60 s instead of resuming (torch 2.14, measured for both).
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` on every agent avoids it. An elastic job whose
    first round has one node gets no notice: torchrun does not tell the ranks ``MAX``.

    Args:
        environ: The process environment (``os.environ``).

    Returns:
        One line naming the sizes and the fix, or ``None`` when the launch is not affected.
    """
    nodes = environ.get("GROUP_WORLD_SIZE", "1")
    restarts = environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if (
        environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        or not nodes.isdigit()
        or int(nodes) < 2
        or not restarts.isdigit()
        or int(restarts) < 1
    ):
        return None
    return (
        f"torchrun runs {nodes} nodes with --max-restarts={restarts} and one rendezvous store "
        "shared by all rounds (torch's default): a node started to replace a lost one, or "
        "one returning to an elastic --nnodes=MIN:MAX job, cannot join it (the agents fail "
        "after 60 s); start every agent with "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (docs/resiliency.md, 'Several nodes')"
    )


def _writable_directory(directory: Path, what: str) -> None:
    """Require that ``directory`` exists as a writable directory or can be created."""
    probe = directory
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(
            what,
            f"{str(directory)!r} cannot be created: {str(probe)!r} is a file, not a "
            "directory; choose another path",
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        reason = "is on a read-only filesystem or not writable by this user"
        raise ConfigError(
            what,
            f"{str(directory)!r} cannot be written: {str(probe)!r} {reason}; choose a "
            "writable path",
        )


def check_output_file(path: str | os.PathLike[str], what: str) -> None:
    """Require that the file ``path`` can be created or appended to.

    Args:
        path: The file the run will write.
        what: The option or field that names it (``--metrics-file``), for the message.

    Raises:
        ConfigError: the path is a directory, its directory cannot be created or written,
            or the file exists and is not writable.
    """
    file = Path(path)
    if file.is_dir():
        raise ConfigError(what, f"{str(file)!r} is a directory; give a file path")
    if file.exists():
        if not os.access(file, os.W_OK):
            raise ConfigError(what, f"{str(file)!r} is not writable; choose a writable path")
        return
    _writable_directory(file.parent if str(file.parent) else Path("."), what)


def check_writable_directory(path: str | os.PathLike[str], what: str) -> None:
    """Require that the directory ``path`` exists as a writable directory or can be created.

    Args:
        path: The directory the run will write to.
        what: The field that names it (``logger.tensorboard_dir``), for the message.

    Raises:
        ConfigError: naming the field and the path.
    """
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(what, f"{str(directory)!r} is a file, not a directory")
    _writable_directory(directory, what)


class Terminated(BaseException):
    """The run received SIGTERM (raised in the main thread by :func:`interrupt_handlers`).

    A ``BaseException``, as ``KeyboardInterrupt`` is: code that reports any ``Exception``
    in its own words (a config ``_target_`` import, a data loader, megatron-core) must not
    turn the signal into an error of its own (it did: "model._target_: importing ... failed").
    """


@contextmanager
def interrupt_handlers() -> Iterator[None]:
    """Turn the first SIGINT/SIGTERM into an exception; keep later ones from breaking teardown.

    The first SIGINT raises ``KeyboardInterrupt`` and the first SIGTERM :class:`Terminated`
    in the main thread. After that, SIGTERM is ignored (a scheduler often sends several)
    and a second SIGINT ends the process at once with code 130. Handlers the run installs
    itself (the exit-signal handler of ``train.exit_signal_handler``) take precedence
    while they are installed. The previous handlers are restored on exit.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        if stopping:
            if signum == signal.SIGINT:
                print("bridge-train: interrupted again; exiting now", file=sys.stderr, flush=True)
                os._exit(130)
            return
        stopping = True
        if signum == signal.SIGTERM:
            raise Terminated()
        raise KeyboardInterrupt()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        # After a signal the process is on its way out: more SIGTERMs of the same burst must
        # not kill it before it reports and exits with its own code.
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_IGN if stopping else handler)
