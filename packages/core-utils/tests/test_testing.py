"""The multi-process launcher: ranks may start children; a hang fails and leaves nothing behind."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from core_utils.testing import DistributedTestError, run_distributed


def _square(x: int) -> int:
    return x * x


def _rank_with_a_child(rank: int, world_size: int) -> int:
    # Needs non-daemonic ranks (dist_checkpointing's Manager and DataLoader workers do this).
    ctx = mp.get_context("fork")
    with ctx.Pool(1) as pool:
        value: int = pool.apply(_square, (rank + 2,))
    dist.barrier()
    return value


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_ranks_can_start_child_processes() -> None:
    assert run_distributed(_rank_with_a_child, 2, timeout=50) == [4, 9]


def _hang_with_a_grandchild(rank: int, world_size: int, pid_file: str) -> None:
    child = mp.get_context("fork").Process(target=time.sleep, args=(120,))
    child.start()
    Path(f"{pid_file}.{rank}").write_text(str(child.pid))
    if rank == 0:
        time.sleep(120)  # never reaches the barrier
    dist.barrier()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too: it only waits for its (killed) parent to be reaped.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_hang_times_out_and_kills_every_process(tmp_path: Path) -> None:
    pid_file = str(tmp_path / "child")
    with pytest.raises(DistributedTestError, match=r"ranks \[0, 1\] did not finish within 5 s"):
        run_distributed(_hang_with_a_grandchild, 2, pid_file, timeout=5)
    children = [int(Path(f"{pid_file}.{rank}").read_text()) for rank in range(2)]
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in children)
