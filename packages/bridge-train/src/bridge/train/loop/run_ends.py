"""The two ends every run shares (GPT-style ``pretrain`` and the MIMO recipe alike).

* At the start: which checkpoint a run resumes when ``checkpoint.load`` is unset
  (:func:`adopt_own_save_dir`).
* At the end: the ordered release of what the run started (:func:`run_state_teardown`,
  :func:`run_teardown`), each step logged and never raised over an error that may already
  be propagating.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "TeardownStep",
    "adopt_own_save_dir",
    "run_state_teardown",
    "run_teardown",
    "save_dir_holds_checkpoint",
]

logger = logging.getLogger(__name__)

#: ``(what it does, for the log line if it fails; the action)``
TeardownStep = tuple[str, Callable[[], Any]]


def save_dir_holds_checkpoint(checkpoint: Any) -> bool:
    """Whether ``checkpoint.save`` holds a checkpoint of an earlier run to resume.

    Persistent checkpoints (tracker or complete ``iter_*``) count, and so do global
    non-persistent ones: a run killed before its first persistent save resumes from them.
    """
    from bridge.train.checkpointing import checkpoint_exists
    from bridge.train.checkpointing.context import non_persistent_dir

    if checkpoint_exists(checkpoint.save):
        return True
    if checkpoint.non_persistent_ckpt_type != "global":
        return False
    return checkpoint_exists(non_persistent_dir(checkpoint, base=str(checkpoint.save)))


def adopt_own_save_dir(checkpoint: Any) -> None:
    """Resume the run that owns ``checkpoint.save`` when ``checkpoint.load`` is unset.

    torchrun restarts (and a user re-running the same command) rely on it: the save directory
    holding a checkpoint becomes ``checkpoint.load``. Which checkpoint in it is loaded is
    ``load_checkpoint``'s decision.
    """
    if (
        checkpoint.load is None
        and checkpoint.save is not None
        and save_dir_holds_checkpoint(checkpoint)
    ):
        checkpoint.load = checkpoint.save


def run_state_teardown(state: Any, clean: bool) -> list[TeardownStep]:
    """The steps that release what a ``GlobalState`` holds, in order.

    Pending asynchronous saves are finished first (when the run saves), then fault tolerance
    (``clean``: the job ended normally, so computed timeouts are stored), the straggler
    monitors, the exit-signal handler (after the last save) and the metric writers.
    """
    steps: list[TeardownStep] = []
    cfg = state.cfg
    if cfg.checkpoint is not None and cfg.checkpoint.save is not None:

        def finalize() -> None:
            from bridge.train.checkpointing import finalize_async_saves

            finalize_async_saves(state, blocking=True, terminate=True)

        steps.append(("finishing asynchronous checkpoint saves", finalize))
    steps += [
        ("shutting down fault tolerance", lambda: state.fault_tolerance.shutdown(clean=clean)),
        (
            "stopping the NVRx straggler monitor",
            lambda: state.nvrx_straggler.shutdown() if state.nvrx_straggler else None,
        ),
        ("stopping straggler detection", state.straggler_timing.close),
        (
            "restoring the exit-signal handler",
            lambda: state.exit_conditions.close() if state.exit_conditions else None,
        ),
        ("closing the metric writers", state.metric_writers.close),
    ]
    return steps


def run_teardown(steps: Iterable[TeardownStep], who: str) -> None:
    """Run every step in order; a failing step is logged (``"<who>: <what> failed"``)."""
    for what, action in steps:
        try:
            action()
        except Exception:
            logger.exception("%s: %s failed", who, what)
