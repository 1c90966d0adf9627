"""SLURM as a launcher, against a real slurmctld and two slurmd on this machine.

The example batch script (examples/slurm/pretrain.sbatch) is submitted as written, scaled to
this CPU machine by sbatch options and overrides only (2 tasks, no GPUs, gloo, a 2-layer
GPT on megatron-core's engine), and every task runs ``python -m bridge.train`` under
``srun`` without torchrun:

* on two "nodes", one task each: the losses equal ``torchrun --nproc_per_node=2``'s within
  1e-5 (they are in fact identical: same layout, same reductions);
* preempted: ``scancel --batch --signal=USR1`` (what ``#SBATCH --signal=B:USR1@N`` does at
  the time limit) while every rank waits at iteration 15; the script forwards the signal,
  both ranks save iteration 16 and exit with the requeue code, the script requeues the
  job, SLURM starts it again by itself, and the next allocation resumes from that
  checkpoint: every loss of both
  allocations equals the uninterrupted run's bit for bit, and ``progress.txt`` and the
  metrics carry the job id, node list and requeue count;
* a stale launch environment (``WORLD_SIZE=2`` with nobody else coming) says within
  seconds what it waits for and fails with one line after ``dist.distributed_timeout_minutes``
  (1 minute, the smallest; it runs beside the SLURM jobs, so it adds little time).

The cluster (tests/slurm_cluster.py) starts once for the module and is always stopped.
Without SLURM the tests skip, and fail when ``BRIDGE_REQUIRE_SLURM=1`` (set by .ci/run).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from bridge.train.engine.launch_env import expand_hostlist
from core_utils.testing import find_free_port

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
PRETRAIN_SCRIPT = REPO / "examples" / "slurm" / "pretrain.sbatch"
TRAIN_ITERS = 40
GATE_ITERATION = 15
#: The example's tiny_gpt recipe scaled down: the same overrides for every launch here.
OVERRIDES: tuple[str, ...] = (
    f"train.train_iters={TRAIN_ITERS}",
    "train.eval_interval=null",
    "train.eval_iters=0",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.seq_length=64",
    "scheduler.lr_warmup_iters=2",
    "logger.log_interval=10",
    "logger.log_progress=true",
)
#: sbatch options that scale the GPU script to this machine (the #SBATCH lines stay as written).
CPU_OPTIONS: tuple[str, ...] = ("--gpus-per-node=0", "--cpus-per-task=1", "--time=30")

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess, pytest.mark.slow]


def _sibling(name: str) -> ModuleType:
    """A helper module of this directory (tests/ is not a package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, TESTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


slurm = _sibling("slurm_cluster")


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    env["PYTHONDONTWRITEBYTECODE"] = ""  # else every rank compiles torch again
    return env


def losses(metrics: Path) -> list[tuple[int, float]]:
    """``(iteration, lm loss)`` of every record of a ``--metrics-file``, in file order."""
    if not metrics.exists():
        return []
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [(int(r["step"]), r["lm loss"]) for r in records if "lm loss" in r]


def wait_until(condition: Callable[[], bool], timeout: float, what: str, log: Path) -> None:
    """Poll ``condition``; fail with the job's output after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            text = log.read_text(errors="replace")[-6000:] if log.exists() else "<no output>"
            pytest.fail(f"no {what} within {timeout:.0f} s:\n{text}")
        time.sleep(0.2)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def stale_launch(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[subprocess.Popen[str], float]]:
    """``bridge-train`` with ``WORLD_SIZE=2 RANK=0`` and nobody else coming, started first so
    that its minute of waiting overlaps the SLURM jobs; the last test collects it."""
    directory = tmp_path_factory.mktemp("stale")
    env = _env(WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()))
    cmd = [
        sys.executable,
        "-m",
        "bridge.train",
        "--no-print-config",
        *OVERRIDES,
        "dist.distributed_timeout_minutes=1",
        f"checkpoint.save={directory / 'ckpt'}",
    ]
    proc = subprocess.Popen(
        cmd, env=env, cwd=directory, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        yield proc, time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, stale_launch: object) -> Iterator[Any]:
    """The module's SLURM cluster (see tests/slurm_cluster.py)."""
    slurm.require_slurm()
    with slurm.slurm_cluster(tmp_path_factory.mktemp("slurm")) as running:
        yield running


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, stale_launch: object) -> dict[int, float]:
    """Per-iteration losses of ``torchrun --nproc_per_node=2`` on the same config."""
    directory = tmp_path_factory.mktemp("torchrun")
    metrics = directory / "metrics.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={find_free_port()}",
        "-m",
        "bridge.train",
        "--recipe",
        "tiny_gpt",
        "--no-print-config",
        "--metrics-file",
        str(metrics),
        *OVERRIDES,
        "dist.distributed_backend=gloo",
        f"checkpoint.save={directory / 'ckpt'}",
    ]
    result = subprocess.run(
        cmd, env=_env(), cwd=directory, capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, result.stderr[-6000:]
    records = dict(losses(metrics))
    assert sorted(records) == list(range(1, TRAIN_ITERS + 1))
    return records


def submit(
    cluster: Any, directory: Path, options: tuple[str, ...], args: tuple[str, ...] = ()
) -> tuple[int, Path, Path]:
    """sbatch the example script for a run in ``directory``: ``(job id, output, run dir)``."""
    run_dir = directory / "run"
    output = directory / "job.out"
    env = _env(PYTHON=sys.executable, BACKEND="gloo", RUN_DIR=str(run_dir), PYTHONPATH=str(TESTS))
    job = cluster.sbatch(
        PRETRAIN_SCRIPT,
        [*CPU_OPTIONS, f"--output={output}", *options],
        [*OVERRIDES, *args],
        env=env,
        cwd=REPO,
    )
    return job, output, run_dir


FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def wait_for_state(
    cluster: Any, job: int, states: tuple[str, ...], output: Path, timeout: float = 600
) -> dict[str, str]:
    """Wait until the job is in one of ``states``; its ``scontrol show job`` fields."""
    seen: dict[str, str] = {}

    def reached() -> bool:
        fields = cluster.job(job)
        if fields is not None:
            seen.update(fields)
        return seen.get("JobState") in states

    wait_until(reached, timeout, f"job {job} in {states} (now {seen.get('JobState')})", output)
    return seen


def wait_for_job_end(cluster: Any, job: int, output: Path) -> dict[str, str]:
    """Wait until the job finished; assert it completed with exit code 0."""
    fields = wait_for_state(cluster, job, FINISHED, output)
    text = output.read_text(errors="replace")[-6000:] if output.exists() else ""
    assert (fields["JobState"], fields.get("ExitCode")) == ("COMPLETED", "0:0"), (fields, text)
    return fields


def progress_lines(run_dir: Path) -> list[list[str]]:
    """``progress.txt`` split into fields."""
    text = (run_dir / "checkpoints" / "progress.txt").read_text()
    return [line.split("\t") for line in text.splitlines()]


# --------------------------------------------------------------------------- tests


@pytest.mark.timeout(900)
def test_sbatch_on_two_nodes_equals_torchrun(
    cluster: Any, reference: dict[int, float], tmp_path: Path
) -> None:
    nodes = cluster.nodes
    if len(nodes) < 2:
        pytest.skip("this host is named localhost: the test cluster has one node")
    job, output, run_dir = submit(cluster, tmp_path, ("--nodes=2", "--ntasks-per-node=1"))
    wait_for_job_end(cluster, job, output)
    text = output.read_text()
    assert f"[slurm] job {job}: srun exited with code 0" in text, text[-6000:]
    records = losses(run_dir / "metrics.jsonl")
    assert [step for step, _ in records] == list(range(1, TRAIN_ITERS + 1))
    worst = max(abs(loss - reference[step]) for step, loss in records)
    assert worst <= 1e-5, (worst, records, reference)
    # The job as the progress log and the metrics record it.
    starting = progress_lines(run_dir)[0]
    assert starting[1] == f"Job ID: {job}" and starting[3] == "Starting job", starting
    assert sorted(expand_hostlist(starting[4].removeprefix("Nodes: "))) == sorted(nodes)
    assert starting[5] == "Requeue count: 0"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {"step": 0, "slurm/requeue_count": 0.0, "slurm/job_id": float(job)} in metrics


@pytest.mark.timeout(900)
def test_preempted_job_saves_is_requeued_and_resumes_bit_exactly(
    cluster: Any, reference: dict[int, float], tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    hold = f"callbacks=[{{_target_: slurm_step_gate.StepGate, iteration: {GATE_ITERATION}, gate: '{gate}'}}]"
    job, output, run_dir = submit(
        cluster, tmp_path, ("--nodes=1", "--ntasks-per-node=2", "--requeue"), (hold,)
    )
    waiting = [Path(f"{gate}.waiting.rank{rank}") for rank in (0, 1)]
    wait_until(lambda: all(p.exists() for p in waiting), 600, "ranks waiting at the gate", output)
    # What --signal=B:USR1@N does at the time limit: the signal to the batch shell only.
    cluster.command("scancel", "--batch", "--signal=USR1", str(job))
    wait_until(
        lambda: all(
            re.search(rf"rank {rank} \(pid \d+\) received SIGUSR1", output.read_text())
            for rank in (0, 1)
        ),
        120,
        "SIGUSR1 at both ranks",
        output,
    )
    gate.touch()
    # Requeued by the script; SLURM starts it again by itself after cred_expire (10 s here,
    # see tests/slurm_cluster.py), in a new allocation of the same job.
    wait_until(lambda: (cluster.job(job) or {}).get("Restarts") == "1", 300, "the requeue", output)
    wait_for_job_end(cluster, job, output)

    text = output.read_text()
    stopped = GATE_ITERATION + 1
    assert f"[bridge-train] exiting after iteration {stopped}: a rank received SIGUSR1" in text
    assert (
        f"[slurm] job {job}: the run stopped before its end (srun exit code 75); requeueing it"
        in text
    )
    assert "requeued 1 times" in text
    assert (
        f"checkpoint of iteration {stopped} from {run_dir / 'checkpoints' / f'iter_{stopped:07d}'}"
        in text
    )
    assert text.rstrip().endswith(f"[slurm] job {job}: srun exited with code 0"), text[-3000:]
    records = losses(run_dir / "metrics.jsonl")
    steps = [step for step, _ in records]
    assert steps == [*range(1, stopped + 1), *range(stopped + 1, TRAIN_ITERS + 1)]
    for step, loss in records:
        assert loss == reference[step], (step, loss, reference[step])
    # Job id, node list and requeue count, per allocation.
    starts = [fields for fields in progress_lines(run_dir) if fields[3] == "Starting job"]
    assert [f[5] for f in starts] == ["Requeue count: 0", "Requeue count: 1"]
    assert all(f[1] == f"Job ID: {job}" for f in starts)
    saved = [f[4] for f in progress_lines(run_dir) if f[3] == "Saved checkpoint"]
    assert saved[0] == f"Iteration: {stopped}" and saved[-1] == f"Iteration: {TRAIN_ITERS}"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    job_records = [r for r in metrics if "slurm/requeue_count" in r]
    assert job_records == [
        {"step": 0, "slurm/requeue_count": 0.0, "slurm/job_id": float(job)},
        {"step": stopped, "slurm/requeue_count": 1.0, "slurm/job_id": float(job)},
    ]


@pytest.mark.timeout(300)
def test_stale_launch_environment_fails_within_the_rendezvous_timeout_in_one_line(
    stale_launch: tuple[subprocess.Popen[str], float],
) -> None:
    proc, started = stale_launch
    _, err = proc.communicate(timeout=240)
    elapsed = time.monotonic() - started
    assert proc.returncode == 2, err[-4000:]
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    waiting = [line for line in lines if "has waited" in line]
    assert len(waiting) == 1, err[-4000:]
    assert "rank 0 has waited" in waiting[0] and "for 2 ranks to meet at 127.0.0.1:" in waiting[0]
    assert "WORLD_SIZE=2 from the environment" in waiting[0]
    assert "gives up after 60 s (dist.distributed_timeout_minutes)" in waiting[0]
    last = lines[-1]
    assert last.startswith(
        "bridge-train: error: WORLD_SIZE, MASTER_ADDR, MASTER_PORT: rank 0 waited"
    ), err[-4000:]
    assert "1/2 clients joined" in last and "unset RANK, WORLD_SIZE" in last
    assert elapsed >= 60  # it waited the whole rendezvous timeout, not less
