"""FaultTolerance: which implementation the config selects, and its errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bridge.config import FaultToleranceConfig
from bridge.resiliency import (
    ActiveFaultTolerance,
    FaultTolerance,
    MissingExtraError,
    NullFaultTolerance,
    ResiliencyError,
    WatchdogTimeouts,
)
from bridge.resiliency._ft_state import ft_state_path, read_ft_state, write_ft_state


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
