"""Fault-tolerance hooks a training loop calls, whatever is switched on.

Build one object per rank with :meth:`FaultTolerance.from_config` and call its hooks at
fixed points of the loop. What the hooks do depends on the configuration:

=====================================  ==================================================
configuration                          behaviour
=====================================  ==================================================
nothing on                             :class:`NullFaultTolerance`: every hook returns at
                                       once (one Python method call)
``ft.enable_ft_package``               reports setup / steps / checkpoint saves to
                                       nvidia-resiliency-ext's rank monitor (sections or
                                       heartbeats, see below); needs ``ft_launcher`` and
                                       ``pip install bridge-resiliency[nvrx]``
``hang_timeout=...`` (argument), no    the built-in :class:`~bridge.resiliency.HangWatchdog`
``enable_ft_package``                  kills a rank that stops making progress; use with
                                       ``torchrun --max-restarts``
``ft.simulate_fault``                  schedules a real fault (:class:`SimulatedFault`)
                                       when setup ends; combines with either monitor
=====================================  ==================================================

Order of the hooks in a loop (every rank, same order)::

    ft = FaultTolerance.from_config(cfg.ft, checkpoint_dir=cfg.checkpoint.save)
    ft.on_setup_start()                  # right after torch.distributed is initialised
    ...build model, load checkpoint...
    ft.on_setup_end(checkpoint_loaded=True)
    while training:
        ft.on_step_start()
        train_step(...)
        ft.on_step_end()
        if async saves are pending:
            with ft.checkpointing(async_finalization=True):
                finalize_async_saves(...)
        if saving:
            with ft.checkpointing():     # = on_checkpoint_start() / on_checkpoint_end()
                save_checkpoint(...)     # an async save's synchronous part included
        if evaluating:
            for each eval step: ft.on_eval_step_start(); eval_step(...); ft.on_eval_step_end()
    ft.shutdown()                        # in a ``finally``; ft.shutdown(clean=False) on errors

Warm-up: the first training step and the first evaluation step compile, allocate and fill
caches, so neither is held to the step timeout: the NVRx rank monitor sees them out of its
``step`` section (sections mode) or before its first heartbeat (heartbeats mode, where the
initial timeout covers setup and the first step); the built-in watchdog times them with its
``setup`` timeout (:class:`~bridge.resiliency.WatchdogTimeouts`).

Checkpointing sections nest: a save that first waits for the previous asynchronous save
(``checkpointing(async_finalization=True)`` inside ``checkpointing()``) is one section to
the monitors, which ends with the outer block. A section counts as a save (computed timeouts
are updated when it ends) unless every block in it was an ``async_finalization`` one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from bridge.config import FaultToleranceConfig
from bridge.resiliency._nvrx_monitor import WARMUP_STEPS, NVRxMonitor
from bridge.resiliency.errors import ResiliencyError
from bridge.resiliency.hang_watchdog import HangWatchdog, WatchdogTimeouts
from bridge.resiliency.simulated_fault import SimulatedFault
from core_utils.distributed import global_rank, global_world_size

__all__ = ["ActiveFaultTolerance", "FaultTolerance", "NullFaultTolerance"]

logger = logging.getLogger(__name__)


class FaultTolerance:
    """The hooks every fault-tolerance implementation offers (all do nothing here).

    Subclasses: :class:`NullFaultTolerance` (everything off) and
    :class:`ActiveFaultTolerance`. Build instances with :meth:`from_config`.
    """

    enabled: bool = False
    """Whether any fault-tolerance feature is on."""

    @staticmethod
    def from_config(
        config: FaultToleranceConfig | None,
        *,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        async_save: bool = False,
        hang_timeout: float | WatchdogTimeouts | None = None,
    ) -> FaultTolerance:
        """Build this rank's fault-tolerance hooks.

        Nothing is started here; :meth:`on_setup_start` starts monitoring. A missing
        nvidia-resiliency-ext is reported by :meth:`on_setup_start` too, so building the
        object never fails for an environment reason.

        Args:
            config: The ``ft`` section (``None``: everything off unless ``hang_timeout``).
            checkpoint_dir: ``checkpoint.save``; required with ``enable_ft_package`` (the
                computed timeouts are stored there as ``ft_state.json``).
            rank: This process's global rank (default: torch.distributed's, else ``$RANK``).
            world_size: World size (default: torch.distributed's, else ``$WORLD_SIZE``).
            async_save: ``checkpoint.async_save``: checkpointing timeouts are then not
                computed (async save times vary too much).
            hang_timeout: Seconds a step may take (or per-phase :class:`WatchdogTimeouts`,
                e.g. ``WatchdogTimeouts.parse("step:60,setup:900,checkpointing:600")``)
                before the built-in watchdog kills the rank; seconds alone leave setup,
                the warm-up step and checkpointing untimed. Used when
                ``enable_ft_package`` is off (e.g. next to megatron-core 0.19, which
                cannot share an environment with nvidia-resiliency-ext 0.4); ignored with
                a warning when it is on (the rank monitor then detects hangs).

        Returns:
            A :class:`NullFaultTolerance` when nothing is on, else an
            :class:`ActiveFaultTolerance`.

        Raises:
            ResiliencyError: ``enable_ft_package`` without ``checkpoint_dir``, or a
                ``simulated_fault_rank`` outside the job.
        """
        use_nvrx = config is not None and config.enable_ft_package
        simulate = config is not None and config.simulate_fault
        if not (use_nvrx or simulate or hang_timeout is not None):
            return NullFaultTolerance()
        rank = global_rank(launcher_fallback=True) if rank is None else rank
        world_size = global_world_size(launcher_fallback=True) if world_size is None else world_size
        fault_rank = config.simulated_fault_rank if config is not None and simulate else None
        if fault_rank is not None and not 0 <= fault_rank < world_size:
            raise ResiliencyError(
                f"ft.simulated_fault_rank: got {fault_rank}; the job has "
                f"ranks 0 to {world_size - 1}"
            )
        watchdog: HangWatchdog | None = None
        nvrx: NVRxMonitor | None = None
        if use_nvrx:
            assert config is not None
            if checkpoint_dir is None:
                raise ResiliencyError(
                    "ft.enable_ft_package: needs checkpoint_dir (checkpoint.save): restarts "
                    "resume from checkpoints and the computed timeouts are stored there"
                )
            nvrx = NVRxMonitor(
                checkpoint_dir=checkpoint_dir,
                rank=rank,
                calc_timeouts=config.calc_ft_timeouts,
                async_save=async_save,
            )
            if hang_timeout is not None:
                logger.warning(
                    "hang_timeout is ignored: ft.enable_ft_package is on and the "
                    "nvidia-resiliency-ext rank monitor detects hangs"
                )
        elif hang_timeout is not None:
            timeouts = (
                hang_timeout
                if isinstance(hang_timeout, WatchdogTimeouts)
                else WatchdogTimeouts(step=float(hang_timeout))
            )
            watchdog = HangWatchdog(timeouts, rank=rank)
        return ActiveFaultTolerance(
            config=config,
            rank=rank,
            world_size=world_size,
            nvrx=nvrx,
            watchdog=watchdog,
        )

    @property
    def monitor(self) -> str:
        """Which progress monitor runs: ``"none"``, ``"watchdog"``, ``"nvrx-sections"``
        or ``"nvrx-heartbeats"`` (the NVRx mode is known after :meth:`on_setup_start`)."""
        return "none"

    def timeouts(self) -> dict[str, Any]:
        """The timeouts currently in force (for logs), empty when none."""
        return {}

    def on_setup_start(self) -> None:
        """Start monitoring; call once, right after torch.distributed is initialised."""
        return None

    def on_setup_end(self, checkpoint_loaded: bool = False) -> None:
        """Setup is over (model built, checkpoint loaded): training begins.

        Args:
            checkpoint_loaded: Setup loaded a checkpoint (only then is its duration used
                to compute the setup timeout).
        """
        return None

    def on_step_start(self) -> None:
        """A training step begins."""
        return None

    def on_step_end(self) -> None:
        """The training step ended (after the optimizer step)."""
        return None

    def on_eval_step_start(self) -> None:
        """An evaluation step begins."""
        return None

    def on_eval_step_end(self) -> None:
        """The evaluation step ended."""
        return None

    def on_checkpoint_start(self) -> None:
        """A checkpoint save (or a wait for an async save to finish) begins.

        Calls nest: only the outermost start and end delimit the checkpointing section.
        """
        return None

    def on_checkpoint_end(self, async_finalization: bool = False) -> None:
        """The checkpoint save ended.

        When this ends the outermost section of a save, computed timeouts are updated
        (a collective when ``calc_ft_timeouts`` is on: every rank must make the same calls).

        Args:
            async_finalization: This ended a wait for an earlier async save to finish
                rather than a save (no timeout update for it).
        """
        return None

    @contextmanager
    def checkpointing(self, async_finalization: bool = False) -> Iterator[None]:
        """Wrap a checkpoint save (``on_checkpoint_start`` / ``on_checkpoint_end``).

        Use ``checkpointing()`` around the save call (for an async save: its synchronous
        part) and ``checkpointing(async_finalization=True)`` around a wait for async saves
        to finish. When the block raises, the end hook is not called (it may be a
        collective the other ranks never reach); call ``shutdown(clean=False)``.

        Args:
            async_finalization: The block finalises earlier async saves.
        """
        self.on_checkpoint_start()
        yield
        self.on_checkpoint_end(async_finalization=async_finalization)

    def shutdown(self, clean: bool = True) -> None:
        """Stop monitoring (idempotent).

        Args:
            clean: The loop finished normally on every rank: computed timeouts are updated
                (a collective) and stored. Pass ``False`` when leaving on an error, so no
                collective is attempted.
        """
        return None


class NullFaultTolerance(FaultTolerance):
    """Fault tolerance switched off: every hook is an empty method.

    A hook call costs one Python method call (tens of nanoseconds), nothing next to a
    training step.
    """


class ActiveFaultTolerance(FaultTolerance):
    """Fault tolerance with a progress monitor and/or a simulated fault.

    Built by :meth:`FaultTolerance.from_config`; see the module documentation for what
    each configuration does.

    Args:
        config: The ``ft`` section (may be ``None`` with a watchdog only).
        rank: Global rank.
        world_size: World size.
        nvrx: The nvidia-resiliency-ext monitor, if ``enable_ft_package``.
        watchdog: The built-in hang watchdog, if configured.
    """

    enabled = True

    def __init__(
        self,
        *,
        config: FaultToleranceConfig | None,
        rank: int,
        world_size: int,
        nvrx: NVRxMonitor | None,
        watchdog: HangWatchdog | None,
    ) -> None:
        if nvrx is not None and watchdog is not None:
            raise ResiliencyError("use either the NVRx rank monitor or the hang watchdog")
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.nvrx = nvrx
        self.watchdog = watchdog
        self.simulated_fault: SimulatedFault | None = None
        self._started = False
        self._setup_done = False
        self._closed = False
        self._steps_started = 0
        self._eval_steps_started = 0
        # Nesting depth of checkpointing sections, whether one of the nested blocks was a
        # save, and the watchdog phase the outermost one interrupted.
        self._checkpoint_depth = 0
        self._checkpoint_saved = False
        self._phase_before_checkpoint: tuple[str, bool] | None = None

    @property
    def monitor(self) -> str:
        """Which progress monitor runs (see :attr:`FaultTolerance.monitor`)."""
        if self.nvrx is not None:
            return f"nvrx-{self.nvrx.mode}" if self.nvrx.mode else "nvrx"
        return "watchdog" if self.watchdog is not None else "none"

    @property
    def state_path(self) -> str | None:
        """Path of the stored computed timeouts (``None`` without NVRx)."""
        return str(self.nvrx.state_path) if self.nvrx is not None else None

    def timeouts(self) -> dict[str, Any]:
        """The timeouts in force: NVRx's (after setup start) or the watchdog's.

        The watchdog's warm-up step runs under its ``setup`` timeout.
        """
        if self.nvrx is not None:
            return self.nvrx.timeouts()
        if self.watchdog is not None:
            t = self.watchdog.timeouts
            return {
                "setup": t.setup,
                "step": t.step,
                "checkpointing": t.checkpointing,
                "out_of_section": t.for_phase("out_of_section"),
            }
        return {}

    def on_setup_start(self) -> None:
        """Start the progress monitor (see :meth:`FaultTolerance.on_setup_start`).

        Raises:
            MissingExtraError: ``enable_ft_package`` without nvidia-resiliency-ext.
            ResiliencyError: ``enable_ft_package`` but not launched by ``ft_launcher``,
                or called twice.
        """
        if self._started:
            raise ResiliencyError("FaultTolerance.on_setup_start was already called")
        self._started = True
        if self.nvrx is not None:
            self.nvrx.start()
        if self.watchdog is not None:
            self.watchdog.start()

    def on_setup_end(self, checkpoint_loaded: bool = False) -> None:
        """End setup and schedule the simulated fault (a collective when its rank is random).

        Args:
            checkpoint_loaded: Setup loaded a checkpoint.
        """
        if not self._started:
            self.on_setup_start()
        if self._setup_done:
            return
        self._setup_done = True
        if self.nvrx is not None:
            self.nvrx.setup_end(checkpoint_loaded)
        if self.watchdog is not None:
            self.watchdog.enter("out_of_section")
        self.simulated_fault = SimulatedFault.from_config(
            self.config, rank=self.rank, world_size=self.world_size
        )
        if self.simulated_fault is not None:
            # The type and delay are drawn on the target rank; only its log line is exact.
            if self.simulated_fault.is_target:
                logger.warning(
                    "fault tolerance: simulating %s on rank %d in %.2f s",
                    self.simulated_fault.fault_type,
                    self.simulated_fault.target_rank,
                    self.simulated_fault.delay,
                )
                if (
                    self.simulated_fault.fault_type == "rank_hung"
                    and self.watchdog is not None
                    and self.watchdog.timeout_of("step", warmup=True) is None
                ):
                    # Otherwise a drill whose hang lands in the first step waits forever.
                    logger.warning(
                        "fault tolerance: the warm-up (first) step is not timed without a "
                        "setup timeout, so a simulated hang landing in it is never detected; "
                        "give one (--hang-setup-timeout, WatchdogTimeouts.setup) or raise "
                        "ft.simulated_fault_base_delay past the first step"
                    )
            self.simulated_fault.start()

    def on_step_start(self) -> None:
        """A training step begins (ends setup if :meth:`on_setup_end` was not called).

        The first one is the warm-up step (see the module documentation).
        """
        if not self._setup_done:
            self.on_setup_end()
        if self.nvrx is not None:
            self.nvrx.step_start(evaluation=False)
        if self.watchdog is not None:
            self.watchdog.enter("step", warmup=self._steps_started < WARMUP_STEPS)
        self._steps_started += 1

    def on_step_end(self) -> None:
        """The training step ended."""
        if self.nvrx is not None:
            self.nvrx.step_end(evaluation=False)
        if self.watchdog is not None:
            self.watchdog.enter("out_of_section")

    def on_eval_step_start(self) -> None:
        """An evaluation step begins (the first one is a warm-up step)."""
        if not self._setup_done:
            self.on_setup_end()
        if self.nvrx is not None:
            self.nvrx.step_start(evaluation=True)
        if self.watchdog is not None:
            self.watchdog.enter("step", warmup=self._eval_steps_started < WARMUP_STEPS)
        self._eval_steps_started += 1

    def on_eval_step_end(self) -> None:
        """The evaluation step ended."""
        if self.nvrx is not None:
            self.nvrx.step_end(evaluation=True)
        if self.watchdog is not None:
            self.watchdog.enter("out_of_section")

    def on_checkpoint_start(self) -> None:
        """A checkpoint save or an async save's finalisation begins (calls may nest)."""
        self._checkpoint_depth += 1
        if self._checkpoint_depth > 1:
            return
        self._checkpoint_saved = False
        if self.nvrx is not None:
            self.nvrx.checkpoint_start()
        if self.watchdog is not None:
            if self.watchdog.phase is not None:
                self._phase_before_checkpoint = (self.watchdog.phase, self.watchdog.warmup)
            self.watchdog.enter("checkpointing")

    def on_checkpoint_end(self, async_finalization: bool = False) -> None:
        """End a block opened by :meth:`on_checkpoint_start`.

        The outermost end closes the checkpointing section; if any block in it was a save
        (``async_finalization=False``) it counts as a save, so computed timeouts are
        updated (a collective with ``calc_ft_timeouts``). The watchdog returns to the
        phase the section interrupted (between steps, setup, or the step it ran in), with
        a fresh deadline.

        Raises:
            ResiliencyError: No checkpointing section is open.
        """
        if self._checkpoint_depth == 0:
            raise ResiliencyError(
                "FaultTolerance.on_checkpoint_end: no checkpointing section is open; call "
                "on_checkpoint_start() first (or use `with ft.checkpointing(): ...`)"
            )
        self._checkpoint_depth -= 1
        self._checkpoint_saved = self._checkpoint_saved or not async_finalization
        if self._checkpoint_depth > 0:
            return
        if self.nvrx is not None:
            self.nvrx.checkpoint_end(async_finalization=not self._checkpoint_saved)
        if self.watchdog is not None:
            phase, warmup = self._phase_before_checkpoint or ("out_of_section", False)
            self._phase_before_checkpoint = None
            self.watchdog.enter(phase, warmup=warmup)

    def shutdown(self, clean: bool = True) -> None:
        """Update and store computed timeouts (if ``clean``), then stop monitoring."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.nvrx is not None:
                self.nvrx.close(clean=clean and self._started)
        finally:
            if self.watchdog is not None:
                self.watchdog.stop()
