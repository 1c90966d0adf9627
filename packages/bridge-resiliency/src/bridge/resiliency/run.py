"""The resiliency objects of one run, built from their config sections.

:meth:`RunResiliency.build` turns the ``ft``, ``straggler``, ``nvrx_straggler`` sections and
the exit fields of ``train`` into the live objects a loop needs (fault tolerance, straggler
timing, the NVRx straggler monitor, the exit conditions with their signal handler), in the
order a trainer builds them; :meth:`RunResiliency.teardown_steps` releases them in the order
a trainer must. bridge-train's GPT and MIMO runs and the resiliency drills all build theirs
here, and hand each loop component only the object it uses
(:mod:`bridge.resiliency.loop_components`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bridge.config import (
    FaultToleranceConfig,
    NVRxStragglerDetectionConfig,
    StragglerDetectionConfig,
    TrainingConfig,
)
from bridge.resiliency.exit_conditions import ExitConditions
from bridge.resiliency.fault_tolerance import FaultTolerance, NullFaultTolerance
from bridge.resiliency.hang_watchdog import WatchdogTimeouts
from bridge.resiliency.nvrx_straggler import NVRxStragglerMonitor
from bridge.resiliency.straggler import StragglerTiming

__all__ = ["RunResiliency"]


@dataclass
class RunResiliency:
    """Fault tolerance, straggler detection and exit conditions of one run.

    Every field has an inert default, so ``RunResiliency()`` is a run with none of them.

    Attributes:
        fault_tolerance: Fault-tolerance hooks (a no-op object when ``ft`` is off).
        straggler_timing: Per-rank step timing for straggler reports (inert when off).
        nvrx_straggler: The nvidia-resiliency-ext straggler monitor (inert when off).
        exit_conditions: Signal / duration / interval exit conditions; it owns the
            exit-signal handler.
    """

    fault_tolerance: FaultTolerance = field(default_factory=NullFaultTolerance)
    straggler_timing: StragglerTiming = field(default_factory=StragglerTiming)
    nvrx_straggler: NVRxStragglerMonitor | None = None
    exit_conditions: ExitConditions | None = None

    @classmethod
    def build(
        cls,
        *,
        ft: FaultToleranceConfig | None,
        straggler: StragglerDetectionConfig | None,
        nvrx_straggler: NVRxStragglerDetectionConfig | None,
        train: TrainingConfig,
        checkpoint_dir: str | os.PathLike[str] | None,
        async_save: bool = False,
        start_time: float | None = None,
        hang_timeout: float | WatchdogTimeouts | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> RunResiliency:
        """Build the objects from their sections (nothing is monitored yet).

        The exit conditions are built (and the exit-signal handler installed) here, before
        a checkpoint is loaded, so a signal that arrives while loading is not lost.
        Monitoring starts at :meth:`start_setup`, which the caller calls next.

        Args:
            ft: The ``ft`` section.
            straggler: The ``straggler`` section.
            nvrx_straggler: The ``nvrx_straggler`` section.
            train: The ``train`` section (``exit_interval``, ``exit_duration_in_mins``,
                ``exit_signal_handler``, ``exit_signal``).
            checkpoint_dir: ``checkpoint.save`` (computed fault-tolerance timeouts are kept
                there; ``None``: exits save nothing).
            async_save: ``checkpoint.async_save``.
            start_time: ``time.time()`` when the job started (exit duration).
            hang_timeout: Built-in hang watchdog timeouts (see :class:`WatchdogTimeouts`).
            rank: Global rank (default: torch.distributed's, else the launcher's).
            world_size: World size (default likewise).

        Returns:
            The run's resiliency objects.
        """
        fault_tolerance = FaultTolerance.from_config(
            ft,
            checkpoint_dir=checkpoint_dir,
            rank=rank,
            world_size=world_size,
            async_save=async_save,
            hang_timeout=hang_timeout,
        )
        monitor = NVRxStragglerMonitor.from_config(nvrx_straggler, rank=rank)
        timing = StragglerTiming.from_config(straggler, world_size=world_size, rank=rank)
        exits = ExitConditions.from_config(
            train,
            save_enabled=checkpoint_dir is not None,
            start_time=start_time,
            stop_requesters=[monitor],
        )
        return cls(
            fault_tolerance=fault_tolerance,
            straggler_timing=timing,
            nvrx_straggler=monitor,
            exit_conditions=exits,
        )

    def start_setup(self) -> None:
        """Start monitoring: the fault-tolerance setup section opens and NVRx's straggler
        detector starts (when on). The setup section ends at
        ``fault_tolerance.on_setup_end(...)`` once the checkpoint is loaded.

        Raises:
            MissingExtraError: A feature that is on needs nvidia-resiliency-ext.
            ResiliencyError: NVRx straggler detection without CUDA / CUPTI.
        """
        self.fault_tolerance.on_setup_start()
        if self.nvrx_straggler is not None:
            self.nvrx_straggler.initialize()

    def teardown_steps(self, clean: bool) -> list[tuple[str, Callable[[], Any]]]:
        """The ordered steps that release these objects: ``(what, action)`` pairs.

        Fault tolerance first (``clean``: the job ended normally, so computed timeouts are
        stored), then the straggler monitors, then the exit-signal handler (restored after
        the last save, which the caller finishes before these steps).

        Args:
            clean: The run ended normally.
        """
        return [
            ("shutting down fault tolerance", lambda: self.fault_tolerance.shutdown(clean=clean)),
            (
                "stopping the NVRx straggler monitor",
                lambda: self.nvrx_straggler.shutdown() if self.nvrx_straggler else None,
            ),
            ("stopping straggler detection", self.straggler_timing.close),
            (
                "restoring the exit-signal handler",
                lambda: self.exit_conditions.close() if self.exit_conditions else None,
            ),
        ]
