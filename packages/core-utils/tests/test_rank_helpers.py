"""global_rank / global_world_size without a process group: 0 and 1, or the launcher's."""

from __future__ import annotations

import pytest

from core_utils.distributed import collective_device, dist_ready, global_rank, global_world_size


def test_without_a_process_group_one_process_is_assumed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert not dist_ready()
    assert (global_rank(), global_world_size()) == (0, 1)
    assert collective_device().type == "cpu"


def test_launcher_fallback_reads_what_torchrun_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert global_rank(launcher_fallback=True) == 0
    assert global_world_size(launcher_fallback=True) == 1
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert global_rank(launcher_fallback=True) == 3
    assert global_world_size(launcher_fallback=True) == 4


def test_a_malformed_launcher_variable_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ValueError, match=r"\$WORLD_SIZE='four' is not an integer"):
        global_world_size(launcher_fallback=True)
