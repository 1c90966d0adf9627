"""StepCheckpointer: a checkpoint counts only once the tracker names it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from resiliency_drill import TRACKER_FILENAME, StepCheckpointer

from bridge.resiliency import ResiliencyError
from core_utils.testing import run_distributed


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((3,), value)}


def test_save_then_load_returns_the_latest(tmp_path: Path) -> None:
    committed: list[int] = []
    ckpt = StepCheckpointer(tmp_path, rank=0, on_commit=committed.append)
    assert ckpt.load() is None and ckpt.latest_iteration() is None
    assert ckpt.save(10, _state(1.0))
    assert ckpt.save(20, _state(2.0))
    assert not ckpt.save(20, _state(9.0))  # already saved: nothing rewritten
    loaded = ckpt.load()
    assert loaded is not None and loaded.iteration == 20
    assert torch.equal(loaded.state["w"], _state(2.0)["w"])
    assert committed == [10, 20]
    assert (tmp_path / TRACKER_FILENAME).read_text() == "20\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000010",
        "iter_0000020",
        TRACKER_FILENAME,
    ]


def test_an_interrupted_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    ckpt = StepCheckpointer(tmp_path, rank=0)
    ckpt.save(10, _state(1.0))

    def crash(tmp: Path) -> None:
        assert (tmp / "state.pt").exists()
        raise KeyboardInterrupt("killed mid-save")

    with pytest.raises(KeyboardInterrupt):
        ckpt.save(20, _state(2.0), before_commit=crash)
    loaded = ckpt.load()
    assert loaded is not None and loaded.iteration == 10
    assert torch.equal(loaded.state["w"], _state(1.0)["w"])
    assert not (tmp_path / "iter_0000020").exists()
    # The next attempt saves iteration 20 for real.
    assert ckpt.save(20, _state(2.0))
    assert ckpt.latest_iteration() == 20


def test_a_kill_between_rename_and_tracker_leaves_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    ckpt = StepCheckpointer(tmp_path, rank=0)
    ckpt.save(10, _state(1.0))
    renamed: list[Path] = []

    def crash(final: Path) -> None:
        renamed.append(final)
        raise KeyboardInterrupt("killed after the rename, before the tracker")

    with pytest.raises(KeyboardInterrupt):
        ckpt.save(20, _state(2.0), before_tracker=crash)
    # The directory is complete and in place, but the tracker does not name it.
    assert renamed == [tmp_path / "iter_0000020"]
    assert (tmp_path / "iter_0000020" / "state.pt").stat().st_size > 0
    assert (tmp_path / TRACKER_FILENAME).read_text() == "10\n"
    loaded = ckpt.load()
    assert loaded is not None and loaded.iteration == 10
    assert torch.equal(loaded.state["w"], _state(1.0)["w"])
    # Resumed training saves iteration 20 again: the half-committed directory is replaced.
    assert ckpt.save(20, _state(3.0))
    loaded = ckpt.load()
    assert loaded is not None and loaded.iteration == 20
    assert torch.equal(loaded.state["w"], _state(3.0)["w"])
    assert not list(tmp_path.glob(".*")), "temporary or stale entries were left behind"


def test_an_untracked_directory_is_replaced(tmp_path: Path) -> None:
    ckpt = StepCheckpointer(tmp_path, rank=0)
    ckpt.save(10, _state(1.0))
    # A run that died between the rename and the tracker update left iter_0000020 behind.
    orphan = tmp_path / "iter_0000020"
    orphan.mkdir()
    (orphan / "state.pt").write_bytes(b"partial")
    assert ckpt.latest_iteration() == 10
    ckpt.save(20, _state(2.0))
    loaded = ckpt.load()
    assert loaded is not None and torch.equal(loaded.state["w"], _state(2.0)["w"])


def test_a_corrupt_tracker_is_reported(tmp_path: Path) -> None:
    (tmp_path / TRACKER_FILENAME).write_text("ten\n")
    with pytest.raises(ResiliencyError, match="holds 'ten', not an iteration number"):
        StepCheckpointer(tmp_path, rank=0).load()


def _lagging_rank_saves(rank: int, world: int, save_dir: str) -> bool:
    ckpt = StepCheckpointer(save_dir, rank=rank)
    if rank == 1:
        # Rank 1 reads the tracker only after rank 0 committed iteration 10, as a rank that
        # lags a whole save behind does on a loaded machine.
        ckpt.latest_iteration = lambda: 10  # type: ignore[method-assign]
    return ckpt.save(10, {"w": torch.ones(2)})


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_rank_that_reads_the_tracker_late_still_saves_with_the_others(tmp_path: Path) -> None:
    """The "already saved" decision is rank 0's for every rank: a lagging rank that sees the
    tracker rank 0 just wrote does not skip the save's closing barrier (which deadlocked)."""
    assert run_distributed(_lagging_rank_saves, 2, str(tmp_path), timeout=90) == [True, True]
    assert (tmp_path / TRACKER_FILENAME).read_text().strip() == "10"
