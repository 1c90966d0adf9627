"""The resiliency objects as training-loop components (:class:`core_utils.Callback`).

A loop built on :func:`core_utils.loop.run_loop` (bridge-train's runs, bridge.mimo's, this
package's fault drills, or your own) adds these to its components; they read only what
:class:`LoopProgress` names from the loop's context, so they work with any loop.

- :class:`FaultToleranceHeartbeat`: the fault-tolerance step section around every step.
- :class:`StragglerReporter`: a straggler report every ``log_interval`` iterations, with
  the FLOPs of the iterations since the previous report.
- :class:`NVRxStragglerPoll`: collects nvidia-resiliency-ext's straggler assessments each
  step (a stop it asks for reaches the loop through :class:`ExitConditions`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from bridge.resiliency.fault_tolerance import FaultTolerance
from bridge.resiliency.nvrx_straggler import NVRxStragglerMonitor
from bridge.resiliency.straggler import StragglerTiming
from core_utils.callbacks import Callback

__all__ = ["FaultToleranceHeartbeat", "LoopProgress", "NVRxStragglerPoll", "StragglerReporter"]


@runtime_checkable
class LoopProgress(Protocol):
    """What these components read from a loop's context.

    Attributes:
        iteration: Iterations completed (after ``on_step_end``'s step: including it).
        step_flops: Floating-point operations of the latest completed iteration (0 when
            the step did not complete).
    """

    @property
    def iteration(self) -> int: ...

    @property
    def step_flops(self) -> float: ...


class FaultToleranceHeartbeat(Callback):
    """Opens the fault-tolerance step section at step start and closes it at step end.

    Args:
        fault_tolerance: The run's fault-tolerance hooks (a null object when off).
    """

    def __init__(self, fault_tolerance: FaultTolerance) -> None:
        self.fault_tolerance = fault_tolerance

    def on_step_start(self, context: LoopProgress) -> None:
        """Start the step section (heartbeat)."""
        self.fault_tolerance.on_step_start()

    def on_step_end(self, context: LoopProgress) -> None:
        """End the step section (heartbeat), also for a step that stopped the job."""
        self.fault_tolerance.on_step_end()


class StragglerReporter(Callback):
    """Reports per-rank throughput every ``log_interval`` iterations (a collective).

    Owns the FLOPs accumulated since the previous report; inert (and free) when straggler
    detection is off.

    Args:
        timing: The run's straggler timing.
        log_interval: Report every this many iterations.
    """

    def __init__(self, timing: StragglerTiming, log_interval: int) -> None:
        self.timing = timing
        self.log_interval = log_interval
        self.flops_since_report = 0.0
        #: Slowest rank of each report this component made (rank 0's view; ``None`` skipped).
        self.slowest_ranks: list[int] = []

    def on_step_end(self, context: LoopProgress) -> None:
        """Accumulate this iteration's FLOPs; report when the interval is reached."""
        if not self.timing.configured:
            return
        self.flops_since_report += context.step_flops
        iteration = context.iteration
        self.timing.maybe_report(iteration, self.flops_since_report, self.log_interval)
        if iteration % self.log_interval == 0:
            slowest = self.timing.slowest_rank()
            if slowest is not None:
                self.slowest_ranks.append(slowest)
            self.flops_since_report = 0.0


class NVRxStragglerPoll(Callback):
    """Polls nvidia-resiliency-ext's straggler monitor after every step.

    Args:
        monitor: The run's monitor (``None``: nothing to poll).
    """

    def __init__(self, monitor: NVRxStragglerMonitor | None) -> None:
        self.monitor = monitor

    def on_step_end(self, context: LoopProgress) -> None:
        """Collect a finished assessment, if any."""
        if self.monitor is not None:
            self.monitor.poll()
