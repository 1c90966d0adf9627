"""One machine to many: a two-"node" ``bridge-train`` launch on this machine, and a lost node.

Two ``torchrun`` agents, started as separate processes as two machines would start them,
meet at a c10d rendezvous (``--nnodes=2``) and train the drill config
(tests/test_train_fault_drills.py) with a checkpoint every 10 iterations: 1 rank per node
in the default run (against the drills' shared 2-rank reference), 2 per node (4 ranks, data
parallel 4) in the extended tier (a 4-rank reference run and twice the ranks). After a
checkpoint is complete, node 1 is lost: its agent and every process it started are
SIGKILLed, as when a machine dies. A replacement agent is started for that node, as a
cluster scheduler would start one; the surviving agent's workers fail on the lost peers, it
restarts them (``--max-restarts``), the rendezvous admits the replacement, and all ranks
resume from the last complete checkpoint. Every loss either launch logs equals an
uninterrupted run's with the same ranks, bit for bit, and every checkpoint left verifies
against the content checksums recorded at save.

Why a replacement node and not ``--nnodes=1:2`` (the survivor going on alone): a world of
half the ranks after the failure changes the data-parallel size, so the gradient reductions
run in another order and the losses would no longer equal an uninterrupted run's bit for
bit; a replacement keeps the layout, so the comparison is exact. It is also what a
scheduler does with a lost node.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

import psutil
import pytest

from bridge.config import load_config
from bridge.train import pretrain
from bridge.train.checkpointing.integrity import verify_files
from bridge.train.recipes import recipe_path
from core_utils.testing import find_free_port, run_distributed


def _drill_kit() -> ModuleType:
    """``tests/test_train_fault_drills.py`` (launch helpers, the shared 2-rank reference run):
    the module pytest imported, else imported by path under the name pytest gives it, so the
    reference is computed once per session (as tests/test_train_resume.py does)."""
    path = Path(__file__).resolve().with_name("test_train_fault_drills.py")
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file is not None and Path(file).resolve() == path:
            return module
    name = "tests.test_train_fault_drills"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


kit = _drill_kit()
NODES = 2
SAVE_INTERVAL = 10
#: 4 data-parallel ranks (2 per node) need a global batch divisible by 4 micro-batches.
FOUR_RANK_OVERRIDES: tuple[str, ...] = (
    *kit.DRILL_OVERRIDES,
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
)
#: Seconds the first launch's forward steps sleep, so the node is lost mid-run however fast
#: the machine is (at least (TRAIN_ITERS - 20) * 0.05 s remain after the second checkpoint).
FIRST_LAUNCH_STEP_SLEEP = "0.05"
#: Every rendezvous round gets a store of its own (see docs/resiliency.md, "Several nodes"):
#: with the store shared across rounds (torch's default), a node that joins in a later round
#: waits for the worker-store address that only a first round publishes, and the survivors
#: wait for it, until the rendezvous times out.
AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

_REFERENCE: dict[str, dict[int, float]] = {}


def _reference_rank(rank: int, world: int, metrics: str) -> int:
    config = load_config(recipe_path("tiny_gpt"), list(FOUR_RANK_OVERRIDES))
    return pretrain(config, metrics_file=metrics)


def four_rank_reference_losses() -> dict[int, float]:
    """Per-iteration ``lm loss`` of an uninterrupted 4-rank run (forked ranks, once)."""
    if "losses" not in _REFERENCE:
        with tempfile.TemporaryDirectory() as tmp:
            metrics = Path(tmp) / "metrics.jsonl"
            assert run_distributed(_reference_rank, 4, str(metrics), timeout=600) == [0] * 4
            losses = dict(kit.loss_records(metrics))
        assert sorted(losses) == list(range(1, kit.TRAIN_ITERS + 1))
        _REFERENCE["losses"] = losses
    return dict(_REFERENCE["losses"])


def agent_command(
    endpoint: str, run_id: str, *, per_node: int, host: bool, entry: Path, args: Sequence[str]
) -> list[str]:
    """One node's ``torchrun`` agent: the command of docs/resiliency.md ("Several nodes")."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={NODES}",
        f"--nproc-per-node={per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        # The agent of node 0 serves the rendezvous store, the others are its clients (on one
        # machine both addresses are local, so torch cannot tell them apart by itself); a
        # replacement node joins for as long as the survivor waits (join_timeout).
        f"--rdzv-conf=is_host={str(host).lower()},join_timeout=600",
        "--max-restarts=2",
        str(entry),
        "--no-print-config",
        *args,
    ]


@contextlib.contextmanager
def node(cmd: Sequence[str], log: Path, env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """Start one node's agent in a session of its own; on exit kill it and its workers."""
    child_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONDONTWRITEBYTECODE": "",
        **AGENT_ENV,
        **env,
    }
    with log.open("w") as out:
        proc = subprocess.Popen(
            list(cmd), stdout=out, stderr=subprocess.STDOUT, env=child_env, start_new_session=True
        )
        try:
            yield proc
        finally:
            lose_node(proc)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)


def lose_node(agent: subprocess.Popen[bytes]) -> None:
    """SIGKILL a node: the agent's process group and those of the workers it started (torchrun
    starts each worker in a session of its own), then wait until none of them is left."""
    try:
        tree = [psutil.Process(agent.pid), *psutil.Process(agent.pid).children(recursive=True)]
    except psutil.Error:
        tree = []
    groups = {agent.pid}
    for process in tree:
        with contextlib.suppress(psutil.Error):
            groups.add(os.getpgid(process.pid))
    # All at once: a node dies as a whole, none of its ranks takes another step.
    for group in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
    for process in tree:
        with contextlib.suppress(psutil.Error):
            process.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        agent.wait(timeout=30)  # reaped: its group is then empty
    psutil.wait_procs(tree, timeout=30)
    for group in groups:  # anything a worker forked meanwhile
        kit.kill_group(group)


def wait_for(
    condition: object,
    agents: Sequence[subprocess.Popen[bytes]],
    timeout: float,
    what: str,
    logs: Sequence[Path],
) -> None:
    """Poll ``condition`` until it holds; fail with the logs on timeout or an agent's exit."""
    assert callable(condition)
    deadline = time.monotonic() + timeout
    while not condition():
        exited = [a for a in agents if a.poll() is not None]
        if exited or time.monotonic() > deadline:
            why = "an agent exited" if exited else f"nothing within {timeout:.0f} s"
            pytest.fail(f"{why} before {what}:\n" + "\n".join(kit.tail(log, 4000) for log in logs))
        time.sleep(0.05)


def assert_checkpoints_intact(save: Path) -> list[int]:
    """Every ``iter_*`` directory is complete and its files match the recorded checksums;
    returns the saved iterations."""
    iterations = []
    for directory in sorted(save.glob("iter_*")):
        assert not directory.name.endswith(".tmp"), f"uncommitted leftover {directory}"
        marker = json.loads((directory / "checkpoint_complete.json").read_text())
        assert verify_files(directory, marker["files"], collective=False) == [], directory
        iterations.append(int(directory.name.removeprefix("iter_")))
    return iterations


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize(
    "per_node",
    [
        # 2 ranks (1 per node): the default run's check, against the drills' shared reference.
        pytest.param(1, id="1-rank-per-node"),
        # 4 ranks (2 per node, data parallel 4), as the issue asks; twice the processes.
        pytest.param(2, id="2-ranks-per-node", marks=pytest.mark.extended),
    ],
)
def test_two_node_launch_survives_a_lost_node_and_resumes_exactly(
    tmp_path: Path, per_node: int
) -> None:
    """Two agents (``--nnodes=2``, c10d rendezvous); node 1 is lost after a checkpoint; a
    replacement agent joins, the ranks resume from the last complete checkpoint, and every
    loss equals the uninterrupted run's with the same ranks, bit for bit; no checkpoint is
    damaged; no process of any launch is left."""
    if per_node == 1:
        overrides, reference = kit.DRILL_OVERRIDES, kit.reference_losses()
    else:
        overrides, reference = FOUR_RANK_OVERRIDES, four_rank_reference_losses()
    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    entry = kit.write_entry_script(tmp_path)
    args = [
        "--metrics-file",
        str(metrics),
        *overrides,
        f"checkpoint.save={save}",
        f"checkpoint.save_interval={SAVE_INTERVAL}",
    ]
    endpoint, run_id = f"127.0.0.1:{find_free_port()}", f"bridge-test-{uuid.uuid4().hex[:8]}"

    def command(host: bool) -> list[str]:
        return agent_command(endpoint, run_id, per_node=per_node, host=host, entry=entry, args=args)

    slow = {"DRILL_FIRST_ATTEMPT_STEP_SLEEP": FIRST_LAUNCH_STEP_SLEEP}
    logs = [tmp_path / "node0.log", tmp_path / "node1.log", tmp_path / "node1-replacement.log"]
    seen: dict[int, psutil.Process] = {}
    with contextlib.ExitStack() as stack:
        node0 = stack.enter_context(node(command(host=True), logs[0], slow))
        node1 = stack.enter_context(node(command(host=False), logs[1], slow))
        # The second checkpoint, so that the resume is not from the first one by default.
        wait_for(
            lambda: (kit.tracker_iteration(save) or 0) >= 2 * SAVE_INTERVAL,
            [node0, node1],
            900,
            f"the checkpoint of iteration {2 * SAVE_INTERVAL}",
            logs[:2],
        )
        lose_node(node1)
        tracker_at_loss = kit.tracker_iteration(save)
        assert tracker_at_loss is not None and tracker_at_loss < kit.TRAIN_ITERS
        replacement = stack.enter_context(node(command(host=False), logs[2], {}))
        codes = [
            kit.wait_for_exit(agent, 900, log, seen)
            for agent, log in ((node0, logs[0]), (replacement, logs[2]))
        ]
        # Checked before the clean-up: the launches themselves left nothing behind.
        alive = kit.left_running(seen.values(), timeout=30)
    assert not alive, [(p.pid, p.cmdline()) for p in alive]
    output = "\n".join(log.read_text(errors="replace") for log in logs)
    assert codes == [0, 0], output[-8000:]
    assert "rendezvous store shared" not in output  # a store per round: no warning
    assert kit.loaded_message(save, tracker_at_loss) in output, output[-8000:]

    records = kit.loss_records(metrics)
    kit.assert_restarted_from([step for step, _ in records], tracker_at_loss)
    kit.assert_losses_match(records, reference)
    assert kit.tracker_iteration(save) == kit.TRAIN_ITERS
    saved = assert_checkpoints_intact(save)
    assert saved[-1] == kit.TRAIN_ITERS and tracker_at_loss in saved
    progress = (save / "progress.txt").read_text()
    assert progress.count("Starting job") == 2, progress
    assert f"# GPUs: {NODES * per_node}" in progress.splitlines()[-1], progress
