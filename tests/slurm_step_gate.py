"""A training-loop callback that holds every rank before one iteration until a file exists.

Used by tests/test_slurm.py through the example batch script's overrides
(``callbacks=[{_target_: slurm_step_gate.StepGate, ...}]``, with this directory on
``PYTHONPATH``), so that the preemption signal lands at a known iteration however fast or
slow the machine is: every rank announces that it waits (``<gate>.waiting.rank<r>``), the
test signals the job, and once the signal is seen it creates ``<gate>``. The losses do not
change.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core_utils.callbacks import Callback
from core_utils.distributed import global_rank

__all__ = ["StepGate"]


@dataclass
class StepGate(Callback):
    """Wait before the step after ``iteration`` until the file ``gate`` exists (at most 600 s).

    Attributes:
        iteration: Completed iterations at which to wait.
        gate: The file that releases the ranks.
    """

    iteration: int
    gate: str

    def on_step_start(self, context: Any) -> None:
        """Hold this rank at ``iteration`` until the gate file exists."""
        gate = Path(self.gate)
        if context.iteration != self.iteration or gate.exists():
            return
        Path(f"{gate}.waiting.rank{global_rank()}").touch()
        deadline = time.monotonic() + 600
        while not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
