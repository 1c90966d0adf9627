"""RunResiliency: the four objects built from their sections, started and released in order."""

from __future__ import annotations

import signal

from bridge.config import (
    FaultToleranceConfig,
    NVRxStragglerDetectionConfig,
    StragglerDetectionConfig,
    TrainingConfig,
)
from bridge.resiliency import NullFaultTolerance, RunResiliency
from core_utils.testing import find_free_port


def test_nothing_configured_builds_inert_objects() -> None:
    resiliency = RunResiliency.build(
        ft=None,
        straggler=None,
        nvrx_straggler=None,
        train=TrainingConfig(train_iters=4),
        checkpoint_dir=None,
        rank=0,
        world_size=1,
    )
    assert isinstance(resiliency.fault_tolerance, NullFaultTolerance)
    assert not resiliency.straggler_timing.configured
    assert resiliency.nvrx_straggler is not None and not resiliency.nvrx_straggler.enabled
    assert resiliency.exit_conditions is not None
    resiliency.start_setup()  # nothing is on: nothing starts, nothing fails
    assert [what for what, _ in resiliency.teardown_steps(clean=True)] == [
        "shutting down fault tolerance",
        "stopping the NVRx straggler monitor",
        "stopping straggler detection",
        "restoring the exit-signal handler",
    ]
    for _, action in resiliency.teardown_steps(clean=True):
        action()


def test_sections_reach_their_objects_and_teardown_restores_the_signal_handler(
    tmp_path: object,
) -> None:
    before = signal.getsignal(signal.SIGTERM)
    resiliency = RunResiliency.build(
        ft=FaultToleranceConfig(simulate_fault=False),
        straggler=StragglerDetectionConfig(
            log_straggler=True, straggler_ctrlr_port=find_free_port()
        ),
        nvrx_straggler=NVRxStragglerDetectionConfig(enabled=False),
        train=TrainingConfig(train_iters=10, exit_interval=3, exit_signal_handler=True),
        checkpoint_dir=str(tmp_path),
        rank=0,
        world_size=1,
    )
    try:
        exits = resiliency.exit_conditions
        assert exits is not None and exits.signal_handler is not None
        assert signal.getsignal(signal.SIGTERM) is not before  # installed at build
        decision = exits.check(3)
        assert decision.should_exit and decision.should_save  # checkpoint_dir: saves first
        assert resiliency.straggler_timing.configured
    finally:
        for _, action in resiliency.teardown_steps(clean=False):
            action()
    assert signal.getsignal(signal.SIGTERM) == before
