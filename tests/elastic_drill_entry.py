"""The ``bridge-train`` command with the elastic drill's hooks (tests/test_train_multinode.py).

Run by each ``torchrun`` worker in place of ``python -m bridge.train``::

    DRILL_MARKS=DIR DRILL_SAVE=DIR torchrun ... tests/elastic_drill_entry.py [bridge-train arguments]

It calls ``bridge.train.cli.main`` with its arguments and adds only what the test needs to
sequence the drill by files, never by sleeps, and to check the data position
(``MARKS_DIR`` is ``DRILL_MARKS``, ``SAVE_DIR`` is ``DRILL_SAVE``, the directory of
``checkpoint.save``):

* **samples**: every micro-batch's samples are recorded (a digest of each sample's tokens,
  with the iteration they were consumed in) into
  ``MARKS_DIR/samples.from<iteration resumed from>.rank<r>``;
* **first world**: while ``SAVE_DIR`` holds no checkpoint and the world is smaller than
  ``DRILL_FIRST_WORLD``, the worker waits (touching ``MARKS_DIR/small-first-world``) until
  its agent replaces it: when two agents start, the first rendezvous round may complete
  before the second node joined, and torchrun then restarts the workers once it sees the
  node waiting, so the run's first step is always taken on the full world;
* **holds**: ``DRILL_HOLDS=ITER:WORLD,...``: at the iteration after the checkpoint of ``ITER``,
  in a world of ``WORLD`` ranks, the forward step touches ``MARKS_DIR/held.ITER.rank<r>``
  and waits until ``MARKS_DIR/release.ITER`` exists (its agent may replace it first, as
  when a node joins). The test loses or adds a node while every rank is held there.

Each wait gives up after :data:`WAIT_LIMIT` seconds (exit 3), so nothing waits forever.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["WAIT_LIMIT", "recording_step", "resumed_from"]

#: Seconds any hold or wait lasts at most before the worker gives up (exit 3).
WAIT_LIMIT = 600.0
TRACKER = "latest_checkpointed_iteration.txt"


def resumed_from(save: Path) -> int:
    """The iteration the checkpoint tracker of ``save`` names (0 without one)."""
    tracker = save / TRACKER
    return int(tracker.read_text().strip()) if tracker.exists() else 0


def recording_step(
    path: Path, holds: set[tuple[int, int]] | None = None, marks: Path | None = None
) -> Callable[[Any, Any, Any], Any]:
    """:func:`bridge.train.forward_step` recording its samples into ``path``, and holding
    once at each ``(iteration, world)`` of ``holds`` (see the module docstring)."""
    from bridge.train import forward_step
    from bridge.train.testing import SampleRecorder

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), os.environ.get("RANK", "0")
    pending = set(holds or ())

    def step(state: Any, data_iterator: Any, model: Any) -> Any:
        iteration = int(state.train_state.step)
        if (iteration, world) in pending and marks is not None:
            pending.discard((iteration, world))
            (marks / f"held.{iteration}.rank{rank}").touch()
            wait_for(marks / f"release.{iteration}")
        if data_iterator is not None:
            data_iterator = SampleRecorder(data_iterator, state.train_state, path)
        return forward_step(state, data_iterator, model)

    return step


def wait_for(path: Path) -> None:
    """Return once ``path`` exists; exit 3 after :data:`WAIT_LIMIT` seconds."""
    deadline = time.monotonic() + WAIT_LIMIT
    while not path.exists():
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.05)


def _main(argv: list[str]) -> None:
    marks, save = Path(os.environ["DRILL_MARKS"]), Path(os.environ["DRILL_SAVE"])
    world = int(os.environ["WORLD_SIZE"])
    start = resumed_from(save)
    if start == 0 and world < int(os.environ.get("DRILL_FIRST_WORLD", "1")):
        (marks / "small-first-world").touch()
        wait_for(marks / "never")  # replaced by the agent when the other node joins

    import importlib

    from bridge.train.cli import main

    holds = {
        (int(it), int(size))
        for it, size in (
            item.split(":") for item in os.environ.get("DRILL_HOLDS", "").split(",") if item
        )
    }
    module: Any = importlib.import_module("bridge.train.loop.pretrain")
    pretrain = module.pretrain
    step = recording_step(marks / f"samples.from{start}.rank{os.environ['RANK']}", holds, marks)

    def drill_pretrain(config: Any, forward_step_func: Any = None, **kwargs: Any) -> int:
        return int(pretrain(config, step, **kwargs))

    # bridge.train.cli looks the function up on this module when it runs (importlib: the
    # package re-exports the function under the module's name).
    module.pretrain = drill_pretrain
    main(argv)


if __name__ == "__main__":
    _main(sys.argv[1:])
