"""FaultTolerance: which implementation the config selects, and its errors."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from bridge.config import FaultToleranceConfig
from bridge.resiliency import (
    ActiveFaultTolerance,
    FaultTolerance,
    MissingExtraError,
    NullFaultTolerance,
    ResiliencyError,
    SimulatedFault,
    WatchdogTimeouts,
)
from bridge.resiliency._ft_state import ft_state_path, read_ft_state, write_ft_state
from core_utils.testing import run_distributed


def test_everything_off_gives_the_null_object() -> None:
    for config in (None, FaultToleranceConfig()):
        ft = FaultTolerance.from_config(config, checkpoint_dir=None, rank=0, world_size=1)
        assert isinstance(ft, NullFaultTolerance)
        assert not ft.enabled and ft.monitor == "none" and ft.timeouts() == {}
        ft.on_setup_start()
        ft.on_setup_end(checkpoint_loaded=True)
        for _ in range(3):
            ft.on_step_start()
            ft.on_step_end()
            ft.on_eval_step_start()
            ft.on_eval_step_end()
            with ft.checkpointing():
                pass
        ft.shutdown()
        ft.shutdown(clean=False)


def test_null_hooks_are_plain_empty_methods() -> None:
    # The disabled path is one method call per hook: nothing is looked up, allocated or
    # sent (see docs/resiliency.md for the measured cost).
    for hook in ("on_step_start", "on_step_end", "on_checkpoint_start", "on_checkpoint_end"):
        code = getattr(NullFaultTolerance, hook).__code__
        assert code.co_names == (), (hook, code.co_names)


def test_hang_timeout_selects_the_watchdog() -> None:
    ft = FaultTolerance.from_config(None, rank=0, world_size=1, hang_timeout=30)
    assert isinstance(ft, ActiveFaultTolerance)
    assert ft.monitor == "watchdog"
    assert ft.timeouts() == {
        "setup": None,
        "step": 30.0,
        "checkpointing": None,
        "out_of_section": 30.0,
    }
    per_phase = WatchdogTimeouts(step=5, setup=60, checkpointing=120, out_of_section=10)
    ft2 = FaultTolerance.from_config(
        FaultToleranceConfig(), rank=0, world_size=1, hang_timeout=per_phase
    )
    assert isinstance(ft2, ActiveFaultTolerance) and ft2.watchdog is not None
    assert ft2.watchdog.timeouts is per_phase


def test_watchdog_runs_and_stops_cleanly_through_the_hooks() -> None:
    ft = FaultTolerance.from_config(None, rank=0, world_size=1, hang_timeout=60)
    assert isinstance(ft, ActiveFaultTolerance) and ft.watchdog is not None
    ft.on_setup_start()
    assert ft.watchdog.running and ft.watchdog.phase == "setup"
    ft.on_setup_end()
    ft.on_step_start()
    assert ft.watchdog.phase == "step"
    ft.on_step_end()
    with ft.checkpointing():
        assert ft.watchdog.phase == "checkpointing"
    assert ft.watchdog.phase == "out_of_section"
    ft.shutdown()
    assert not ft.watchdog.running
    with pytest.raises(ResiliencyError, match="already called"):
        ft.on_setup_start()


@pytest.mark.parametrize(("setup", "warned"), [(None, True), (60.0, False)])
def test_a_simulated_hang_the_watchdog_may_miss_is_warned_about(
    setup: float | None, warned: bool, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    # The fault itself is not the subject here: do not stop the test process.
    monkeypatch.setattr(SimulatedFault, "_inject", lambda self: None)
    config = FaultToleranceConfig(
        simulate_fault=True, simulated_fault_type="rank_hung", simulated_fault_rank=0
    )
    ft = FaultTolerance.from_config(
        config, rank=0, world_size=1, hang_timeout=WatchdogTimeouts(step=30, setup=setup)
    )
    try:
        with caplog.at_level("WARNING", logger="bridge.resiliency"):
            ft.on_setup_start()
            ft.on_setup_end()
    finally:
        ft.shutdown()
    missed = [r.getMessage() for r in caplog.records if "never detected" in r.getMessage()]
    assert bool(missed) is warned
    if warned:
        assert "--hang-setup-timeout" in missed[0]
        assert "ft.simulated_fault_base_delay" in missed[0]


def test_watchdog_hooks_warm_up_and_nested_checkpointing_sections() -> None:
    timeouts = WatchdogTimeouts(step=60, setup=120, checkpointing=90)
    ft = FaultTolerance.from_config(None, rank=0, world_size=1, hang_timeout=timeouts)
    assert isinstance(ft, ActiveFaultTolerance) and ft.watchdog is not None
    watchdog = ft.watchdog

    def armed() -> tuple[str | None, float | None]:
        assert watchdog.phase is not None
        return watchdog.phase, watchdog.timeout_of(watchdog.phase, warmup=watchdog.warmup)

    try:
        ft.on_setup_start()
        ft.on_setup_end()
        # The first training step (warm-up) runs under the setup timeout, later ones not.
        ft.on_step_start()
        assert armed() == ("step", 120) and watchdog.warmup
        ft.on_step_end()
        assert armed() == ("out_of_section", 60)
        ft.on_step_start()
        assert armed() == ("step", 60) and not watchdog.warmup
        # A wait for an async save inside a step: checkpointing, then back to the step.
        with ft.checkpointing(async_finalization=True):
            assert armed() == ("checkpointing", 90)
        assert armed() == ("step", 60)
        ft.on_step_end()
        # A save that first waits for the previous async save: one checkpointing section.
        with ft.checkpointing():
            with ft.checkpointing(async_finalization=True):
                assert armed() == ("checkpointing", 90)
            assert armed() == ("checkpointing", 90)
        assert armed() == ("out_of_section", 60)
        # Evaluation has its own warm-up step.
        ft.on_eval_step_start()
        assert armed() == ("step", 120)
        ft.on_eval_step_end()
        ft.on_eval_step_start()
        assert armed() == ("step", 60)
        ft.on_eval_step_end()
        with pytest.raises(ResiliencyError, match="no checkpointing section is open"):
            ft.on_checkpoint_end()
        assert watchdog.running
    finally:
        ft.shutdown()
    assert not watchdog.running


# Rank-monitor timeouts and the durations the hooks below produce; computed timeouts are
# observed maxima times _SAFETY, so comparing them with _SAFETY * duration tells which
# section (or heartbeat interval) a duration was measured in.
_SAFETY = 5.0
_WARMUP_STEP = 1.0
_FINALIZATION = 0.3


def _state_snapshot(path: Path) -> tuple[int, dict[str, Any]] | None:
    if not path.exists():
        return None
    return path.stat().st_ino, json.loads(path.read_text())


def _nvrx_hooks_rank(rank: int, world: int, save_dir: str, socket_dir: str, mode: str) -> Any:
    """Drive the hooks against a real rank monitor; snapshot ft_state.json after each phase."""
    from nvidia_resiliency_ext.fault_tolerance.config import (
        FaultToleranceConfig as RankMonitorConfig,
    )
    from nvidia_resiliency_ext.fault_tolerance.rank_monitor_server import RankMonitorServer

    sections = {"setup": 60.0, "step": 60.0, "checkpointing": 60.0}
    config = RankMonitorConfig(
        rank_section_timeouts=sections if mode == "sections" else {},
        rank_out_of_section_timeout=60.0 if mode == "sections" else None,
        initial_rank_heartbeat_timeout=60.0,
        rank_heartbeat_timeout=60.0,
        safety_factor=_SAFETY,
        workload_check_interval=1.0,
        enable_nic_monitor=False,
    )
    socket = os.path.join(socket_dir, f"rank{rank}.socket")
    server = RankMonitorServer.run_in_subprocess(config, socket)
    os.environ["FT_RANK_MONITOR_IPC_SOCKET"] = socket
    state = ft_state_path(save_dir)
    snapshots: dict[str, Any] = {}
    ft = FaultTolerance.from_config(
        FaultToleranceConfig(enable_ft_package=True, calc_ft_timeouts=True),
        checkpoint_dir=save_dir,
        rank=rank,
        world_size=world,
    )
    try:
        ft.on_setup_start()
        snapshots["monitor"] = ft.monitor
        ft.on_setup_end(checkpoint_loaded=True)
        for step in range(17):
            ft.on_step_start()
            time.sleep(_WARMUP_STEP if step == 0 else 0.01)
            ft.on_step_end()
        with ft.checkpointing(async_finalization=True):
            time.sleep(_FINALIZATION)
        snapshots["after_finalization"] = _state_snapshot(state)
        with ft.checkpointing():
            time.sleep(0.02)
        snapshots["after_save"] = _state_snapshot(state)
        with ft.checkpointing(), ft.checkpointing(async_finalization=True):
            time.sleep(0.02)
        snapshots["after_nested_save"] = _state_snapshot(state)
        with ft.checkpointing(async_finalization=True):
            pass
        snapshots["after_second_finalization"] = _state_snapshot(state)
        ft.shutdown(clean=True)
        snapshots["after_shutdown"] = _state_snapshot(state)
    finally:
        ft.shutdown(clean=False)
        server.kill()
        server.join(timeout=30)
    return snapshots


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sections", "heartbeats"])
def test_nvrx_hooks_saves_async_finalizations_and_warm_up(
    nvrx: None, tmp_path: Path, mode: str
) -> None:
    """Against nvidia-resiliency-ext's real rank monitor: a save is a checkpointing section
    after which computed timeouts are stored; an async finalisation is a checkpointing
    section too but stores nothing; nested, they are one save; the warm-up step is kept out
    of the step timeout (sections) or inside the initial heartbeat interval (heartbeats)."""
    # AF_UNIX socket paths are limited to ~100 characters: not under pytest's tmp_path.
    socket_dir = tempfile.mkdtemp(prefix="bridge-rmon-")
    try:
        (snaps,) = run_distributed(
            _nvrx_hooks_rank, 1, str(tmp_path), socket_dir, mode, timeout=100
        )
    finally:
        shutil.rmtree(socket_dir, ignore_errors=True)
    assert snaps["monitor"] == f"nvrx-{mode}"
    # 17 steps observed, but no save yet: the finalisation updates no timeout.
    assert snaps["after_finalization"] is None
    inode, saved = snaps["after_save"]
    timeouts = saved["current_timeouts"]
    if mode == "sections":
        section = timeouts["section"]
        assert section["calculated_sections"] == ["checkpointing", "setup", "step"]
        # The finalisation was measured as checkpointing, and the warm-up step not as a step.
        assert section["section"]["checkpointing"] >= _SAFETY * _FINALIZATION
        assert section["section"]["step"] < _SAFETY * _WARMUP_STEP
        assert not section["is_out_of_section_calculated"]
    else:
        heartbeat = timeouts["heartbeat"]
        assert heartbeat["were_calculated"]
        # No heartbeat at the end of setup: the first interval spans setup and the warm-up.
        assert heartbeat["initial"] >= _SAFETY * _WARMUP_STEP > heartbeat["subsequent"]
    nested_inode, _ = snaps["after_nested_save"]
    assert nested_inode != inode  # the nested section counted as a save: stored again
    assert snaps["after_second_finalization"][0] == nested_inode  # nothing stored
    final_inode, final = snaps["after_shutdown"]
    assert final_inode != nested_inode
    if mode == "sections":
        section = final["current_timeouts"]["section"]
        assert section["is_out_of_section_calculated"]
        # The warm-up step ran out of section (as in megatron's integration).
        assert section["out_of_section"] >= _SAFETY * _WARMUP_STEP


def test_enable_ft_package_needs_a_checkpoint_dir() -> None:
    with pytest.raises(ResiliencyError, match=r"ft\.enable_ft_package: needs checkpoint_dir"):
        FaultTolerance.from_config(
            FaultToleranceConfig(enable_ft_package=True), rank=0, world_size=1
        )


def test_simulated_fault_rank_must_exist() -> None:
    config = FaultToleranceConfig(simulate_fault=True, simulated_fault_rank=4)
    with pytest.raises(
        ResiliencyError, match=r"simulated_fault_rank: got 4; the job has ranks 0 to 1"
    ):
        FaultTolerance.from_config(config, rank=0, world_size=2)


def test_missing_nvrx_is_reported_at_setup_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whether or not it is installed here, make the import fail as it does without the extra.
    monkeypatch.setitem(sys.modules, "nvidia_resiliency_ext", None)
    monkeypatch.setitem(sys.modules, "nvidia_resiliency_ext.fault_tolerance", None)
    ft = FaultTolerance.from_config(
        FaultToleranceConfig(enable_ft_package=True), checkpoint_dir=tmp_path, rank=0, world_size=1
    )
    assert ft.enabled  # building never fails for an environment reason
    with pytest.raises(MissingExtraError) as info:
        ft.on_setup_start()
    message = str(info.value)
    assert "ft.enable_ft_package needs nvidia-resiliency-ext" in message
    assert "pip install bridge-resiliency[nvrx]" in message


def test_enable_ft_package_outside_ft_launcher_says_how_to_launch(
    nvrx: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FT_RANK_MONITOR_IPC_SOCKET", raising=False)
    ft = FaultTolerance.from_config(
        FaultToleranceConfig(enable_ft_package=True), checkpoint_dir=tmp_path, rank=0, world_size=1
    )
    with pytest.raises(
        ResiliencyError, match="not started by nvidia-resiliency-ext's ft_launcher"
    ) as info:
        ft.on_setup_start()
    assert "ft_launcher --nproc-per-node" in str(info.value)
    ft.shutdown(clean=False)


def test_ft_state_file_round_trip_and_errors(tmp_path: Path) -> None:
    path = ft_state_path(tmp_path / "ckpt")
    assert path.name == "ft_state.json" and read_ft_state(path) is None
    state = {"current_timeouts": {"section": {"section": {"step": 3.5}}}}
    write_ft_state(path, state)
    assert read_ft_state(path) == state
    assert [p.name for p in path.parent.iterdir()] == ["ft_state.json"]  # no temp file left
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"is not valid JSON .*delete it"):
        read_ft_state(path)
    path.write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="holds list, expected a JSON object"):
        read_ft_state(path)
