"""Progress reporting to nvidia-resiliency-ext's rank monitor (used by FaultTolerance).

Two modes, chosen from the configuration ``ft_launcher`` hands the rank:

* **sections** when the launcher defines timeouts for the sections ``setup``, ``step`` and
  ``checkpointing`` (``--ft-rank-section-timeouts=setup:600,step:180,checkpointing:420``):
  setup, each step (after the first, which warms up) and each checkpoint save are wrapped
  in their section; everything else counts as "out of section".
* **heartbeats** otherwise: a heartbeat at the end of every step and around every
  checkpoint save (``--ft-rank-heartbeat-timeout`` must then cover a save). None at the end
  of setup: the first heartbeat comes after the first (warm-up) step, so the monitor's
  initial timeout (``--ft-initial-rank-heartbeat-timeout``) covers setup and the warm-up
  step, and the subsequent timeout only steady steps.

With ``calc_ft_timeouts`` the client computes timeouts from what it observed (times its
safety factor), after each synchronous checkpoint and at shutdown, and rank 0 stores them in
``<checkpoint dir>/ft_state.json``; the next start of the job loads them.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from bridge.resiliency._ft_state import ft_state_path, read_ft_state, write_ft_state
from bridge.resiliency.errors import ResiliencyError, missing_nvrx

logger = logging.getLogger(__name__)

SECTIONS = ("setup", "step", "checkpointing")
# The first steps are slow (allocator warm-up, lazy init); they stay out of the "step"
# section so its timeout can be tight.
WARMUP_STEPS = 1
# Steps to observe before the "step" timeout is computed from them.
MIN_STEPS_FOR_TIMEOUT = 16
_RANK_MONITOR_SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"


def import_fault_tolerance(feature: str) -> Any:
    """Import ``nvidia_resiliency_ext.fault_tolerance`` or raise an error naming the extra."""
    try:
        import nvidia_resiliency_ext.fault_tolerance as ft
    except ImportError as exc:
        raise missing_nvrx(feature, exc) from exc
    return ft


class NVRxMonitor:
    """Wraps one rank's ``RankMonitorClient``."""

    def __init__(
        self,
        *,
        checkpoint_dir: str | os.PathLike[str],
        rank: int,
        calc_timeouts: bool,
        async_save: bool,
    ) -> None:
        self.state_path: Path = ft_state_path(checkpoint_dir)
        self.rank = rank
        self.calc_timeouts = calc_timeouts
        self.async_save = async_save
        self.client: Any = None
        self.mode: str | None = None
        self.loaded_state: dict[str, Any] | None = None
        self.setup_open = False
        self.steps_seen = 0
        self.eval_steps_seen = 0
        self.saves_seen = 0
        self.checkpoint_loaded = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        ft = import_fault_tolerance("ft.enable_ft_package")
        if _RANK_MONITOR_SOCKET_ENV not in os.environ:
            raise ResiliencyError(
                "ft.enable_ft_package: this process was not started by nvidia-resiliency-ext's "
                f"ft_launcher (${_RANK_MONITOR_SOCKET_ENV} is unset), so there is no rank "
                "monitor to report to. Launch with `ft_launcher --nproc-per-node=N "
                "--max-restarts=K --ft-rank-section-timeouts=setup:600,step:180,"
                "checkpointing:420 train.py ...`, or switch ft.enable_ft_package off."
            )
        client = ft.RankMonitorClient()
        self.loaded_state = read_ft_state(self.state_path)
        if self.loaded_state is not None:
            # Before init: the client sends the loaded timeouts to its monitor on init.
            client.load_state_dict(self.loaded_state)
        client.init_workload_monitoring()
        self.client = client
        configured = set(client.cfg.rank_section_timeouts)
        missing = [s for s in SECTIONS if s not in configured]
        if not missing:
            self.mode = "sections"
            client.start_section("setup")
            self.setup_open = True
        elif len(missing) < len(SECTIONS):
            raise ResiliencyError(
                f"ft_launcher defines section timeouts for {sorted(configured)} but not for "
                f"{missing}; bridge.resiliency reports the sections {list(SECTIONS)}. Pass all "
                "of them, e.g. --ft-rank-section-timeouts=setup:600,step:180,checkpointing:420, "
                "or none (heartbeat mode)."
            )
        else:
            self.mode = "heartbeats"
        logger.info(
            "fault tolerance: rank %d reports %s to the nvidia-resiliency-ext rank monitor; "
            "timeouts %s",
            self.rank,
            self.mode,
            self.timeouts(),
        )

    def close(self, clean: bool) -> None:
        client, self.client = self.client, None
        if client is None:
            return
        try:
            if clean:
                self._maybe_update_timeouts(client, closing=True)
        finally:
            client.shutdown_workload_monitoring()

    def timeouts(self) -> dict[str, Any]:
        if self.client is None:
            return {}
        if self.mode == "sections":
            st = self.client.section_timeouts
            return {
                "sections": dict(st.section),
                "out_of_section": st.out_of_section,
                "calculated_sections": sorted(st.calculated_sections),
                "out_of_section_calculated": bool(st.is_out_of_section_calculated),
            }
        hb = self.client.hb_timeouts
        return {
            "initial": hb.initial,
            "subsequent": hb.subsequent,
            "calculated": bool(hb.were_calculated),
        }

    # ------------------------------------------------------------------ phases

    def setup_end(self, checkpoint_loaded: bool) -> None:
        self.checkpoint_loaded = self.checkpoint_loaded or checkpoint_loaded
        # Heartbeats mode sends nothing here: the initial heartbeat timeout runs on through
        # the warm-up step (see the module documentation).
        if self.mode == "sections" and self.setup_open:
            self.client.end_section("setup")
            self.setup_open = False

    def step_start(self, evaluation: bool) -> None:
        if self.setup_open:
            self.setup_end(checkpoint_loaded=False)
        seen = self.eval_steps_seen if evaluation else self.steps_seen
        if self.mode == "sections" and seen >= WARMUP_STEPS:
            self.client.start_section("step")

    def step_end(self, evaluation: bool) -> None:
        seen = self.eval_steps_seen if evaluation else self.steps_seen
        if self.mode == "sections":
            if seen >= WARMUP_STEPS:
                self.client.end_section("step")
        else:
            self.client.send_heartbeat()
        if evaluation:
            self.eval_steps_seen += 1
        else:
            self.steps_seen += 1

    def checkpoint_start(self) -> None:
        if self.mode == "sections":
            self.client.start_section("checkpointing")
        else:
            self.client.send_heartbeat()

    def checkpoint_end(self, async_finalization: bool) -> None:
        if self.mode == "sections":
            self.client.end_section("checkpointing")
        else:
            self.client.send_heartbeat()
        # Async finalisations can be no-ops; timeouts are updated on real saves only.
        if not async_finalization:
            self.saves_seen += 1
            self._maybe_update_timeouts(self.client, closing=False)

    # ------------------------------------------------------------------ timeouts

    def _maybe_update_timeouts(self, client: Any, *, closing: bool) -> None:
        """Compute timeouts from observations (a collective) and store them on rank 0."""
        if not self.calc_timeouts:
            return
        if self.mode == "heartbeats":
            if self.steps_seen < MIN_STEPS_FOR_TIMEOUT:
                return
            updated = client.calculate_and_set_hb_timeouts(skip_if_not_ready=True)
        else:
            sections = []
            # Setup time is only representative when it included loading a checkpoint.
            if self.checkpoint_loaded:
                sections.append("setup")
            if self.steps_seen >= MIN_STEPS_FOR_TIMEOUT:
                sections.append("step")
            # Async saves vary too much between runs to derive a timeout from.
            if self.saves_seen > 0 and not self.async_save:
                sections.append("checkpointing")
            out_of_section = (
                closing
                and self.checkpoint_loaded
                and self.steps_seen >= MIN_STEPS_FOR_TIMEOUT
                and self.saves_seen > 0
            )
            if not sections and not out_of_section:
                return
            updated = client.calculate_and_set_section_timeouts(
                selected_sections=sections,
                calc_out_of_section=out_of_section,
                skip_if_not_ready=True,
            )
        if not updated:
            return
        if self.rank == 0:
            write_ft_state(self.state_path, client.state_dict())
        logger.info("fault tolerance: timeouts updated to %s", self.timeouts())
