"""Fault tolerance, straggler detection, exit signals and exit conditions for training loops
(and the loop components that run them: :mod:`bridge.resiliency.loop_components`)."""

from bridge.resiliency.elastic import init_process_group, restart_count
from bridge.resiliency.errors import MissingExtraError, ResiliencyError
from bridge.resiliency.exit_conditions import (
    EXIT_CODE_CLEAN,
    ExitConditions,
    ExitDecision,
    ExitReason,
    StopRequester,
)
from bridge.resiliency.exit_signal import DataloaderSignalGuard, ExitSignalHandler
from bridge.resiliency.fault_tolerance import (
    ActiveFaultTolerance,
    FaultTolerance,
    NullFaultTolerance,
)
from bridge.resiliency.hang_watchdog import HangWatchdog, WatchdogTimeouts
from bridge.resiliency.loop_components import (
    FaultToleranceHeartbeat,
    LoopProgress,
    NVRxStragglerPoll,
    StragglerReporter,
)
from bridge.resiliency.nvrx_straggler import (
    NVRxStragglerMonitor,
    PerfReport,
    StragglerAssessment,
    assess_straggler_report,
    format_perf_scores,
)
from bridge.resiliency.run import RunResiliency
from bridge.resiliency.simulated_fault import FaultType, SimulatedFault
from bridge.resiliency.straggler import StragglerTiming

__all__ = [
    "EXIT_CODE_CLEAN",
    "ActiveFaultTolerance",
    "DataloaderSignalGuard",
    "ExitConditions",
    "ExitDecision",
    "ExitReason",
    "ExitSignalHandler",
    "FaultTolerance",
    "FaultToleranceHeartbeat",
    "FaultType",
    "HangWatchdog",
    "LoopProgress",
    "MissingExtraError",
    "NVRxStragglerMonitor",
    "NVRxStragglerPoll",
    "NullFaultTolerance",
    "PerfReport",
    "ResiliencyError",
    "RunResiliency",
    "SimulatedFault",
    "StopRequester",
    "StragglerAssessment",
    "StragglerReporter",
    "StragglerTiming",
    "WatchdogTimeouts",
    "assess_straggler_report",
    "format_perf_scores",
    "init_process_group",
    "restart_count",
]
