"""Launch environments (bridge.train.engine.launch_env): torchrun, srun, one process.

The rules are pure functions of the environment and are checked here with the variables
torchrun and SLURM 22.05 set (as measured under a real ``srun``; tests/test_slurm.py runs
the trainer under a real SLURM). The rendezvous guard is checked with torch's own store:
a rank 0 whose peers never come, and a rank 1 whose master never listens.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from hypothesis import given, strategies as st

from bridge.config import ConfigError
from bridge.train.engine.launch_env import (
    LaunchEnvironment,
    RendezvousTimeout,
    adopt_launch_environment,
    expand_hostlist,
    first_host,
    guarded_rendezvous,
    launch_environment,
    launch_notice,
    slurm_master_port,
)
from core_utils.testing import find_free_port

#: What srun -N 2 --ntasks-per-node=2 gives its task 3 (SLURM 22.05, measured).
SRUN_TASK = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_NTASKS": "4",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
}
#: The batch script's own environment (no job step): sbatch -n 4.
BATCH_STEP = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_NTASKS": "4",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
}
TORCHRUN_WORKER = {
    "TORCHELASTIC_RUN_ID": "x",
    "GROUP_RANK": "0",
    "LOCAL_WORLD_SIZE": "2",
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "10.0.0.5",
    "MASTER_PORT": "29500",
}


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node1", ["node1"]),
        ("node[01-04,07],login5", ["node01", "node02", "node03", "node04", "node07", "login5"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),
        ("n[001-3]", ["n001", "n002", "n003"]),
        (
            "rack[1-2]-n[1-3]",
            ["rack1-n1", "rack1-n2", "rack1-n3", "rack2-n1", "rack2-n2", "rack2-n3"],
        ),
        ("x[1-2],y", ["x1", "x2", "y"]),
        ("a b,c", ["a", "b", "c"]),
        ("gpu-a[1-2]b", ["gpu-a1b", "gpu-a2b"]),  # scontrol 22.05 refuses a suffix; we keep it
        ("", []),
    ],
)
def test_hostlists_expand_as_slurm_writes_them(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["n[3-1]", "n[1-2", "n]1[", "n[a-b]", "n[1-]"])
def test_invalid_hostlists_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="invalid host list"):
        expand_hostlist(text)


_NAME = st.from_regex(r"[a-z][a-z0-9-]{0,6}", fullmatch=True)


@given(
    prefix=_NAME,
    ranges=st.lists(
        st.tuples(st.integers(0, 120), st.integers(0, 5), st.integers(1, 3)), min_size=1, max_size=3
    ),
)
def test_expansion_matches_a_direct_enumeration(
    prefix: str, ranges: list[tuple[int, int, int]]
) -> None:
    body = ",".join(f"{low:0{width}d}-{low + span:0{width}d}" for low, span, width in ranges)
    expected = [
        f"{prefix}{number:0{width}d}"
        for low, span, width in ranges
        for number in range(low, low + span + 1)
    ]
    assert expand_hostlist(f"{prefix}[{body}]") == expected


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="SLURM's scontrol is not installed")
def test_parser_agrees_with_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf = tmp_path / "slurm.conf"  # scontrol reads one even to expand a host list
    conf.write_text("ClusterName=t\nSlurmctldHost=localhost\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    lists = ["node[01-04,07],login5", "rack[1-2]-n[1-3]", "n[8-11]", "n[001-3]", "x[1-2],y"]
    for text in lists:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", text], capture_output=True, text=True, check=True
        ).stdout.split()
        assert out == expand_hostlist(text), text
        first_host.cache_clear()
        assert first_host(text) == out[0]
    first_host.cache_clear()
    with pytest.raises(ValueError, match="runs backwards"):  # scontrol says "Invalid hostlist"
        first_host("n[3-1]")


def test_srun_task_takes_rank_world_and_master_from_slurm() -> None:
    launch = launch_environment(SRUN_TASK)
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank) == (
        "slurm",
        3,
        4,
        1,
    )
    assert launch.address == f"gpu07:{slurm_master_port('4242')}" == "gpu07:14242"
    assert launch.sources() == (
        "WORLD_SIZE=4 from SLURM_STEP_NUM_TASKS, MASTER_ADDR=gpu07 from the first host of "
        "SLURM_STEP_NODELIST=gpu[07-08], MASTER_PORT=14242 from SLURM_JOB_ID=4242 "
        "(10000 + job id % 20000)"
    )
    # MASTER_ADDR / MASTER_PORT override, and say so.
    custom = launch_environment({**SRUN_TASK, "MASTER_ADDR": "ib-gpu07", "MASTER_PORT": "6000"})
    assert custom.address == "ib-gpu07:6000"
    assert "MASTER_ADDR=ib-gpu07 from MASTER_ADDR set in the environment" in custom.sources()
    # Builds without the step variables: the job's.
    older = {
        k: v
        for k, v in SRUN_TASK.items()
        if k not in ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST")
    }
    assert launch_environment(older).address == "gpu07:14242"
    assert "from SLURM_NTASKS" in launch_environment(older).sources()
    # One task needs no rendezvous.
    alone = launch_environment({**SRUN_TASK, "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"})
    assert (alone.world_size, alone.distributed) == (1, False)


def test_torchrun_variables_win_over_slurm() -> None:
    launch = launch_environment({**SRUN_TASK, **TORCHRUN_WORKER})  # srun torchrun ...
    assert (launch.launcher, launch.rank, launch.world_size, launch.address) == (
        "torchrun",
        1,
        2,
        "10.0.0.5:29500",
    )
    assert launch_environment({}) == LaunchEnvironment("single", 0, 1, 0)


def test_adopting_srun_exports_torch_variables_and_keeps_their_origins() -> None:
    environ = dict(SRUN_TASK)
    launch = adopt_launch_environment(environ)
    assert {
        k: environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    } == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": "14242",
    }
    again = adopt_launch_environment(environ)
    assert again == launch  # the exported values are still read as SLURM's
    # torchrun's workers and bare runs are left as they are.
    torchrun = {**SRUN_TASK, **TORCHRUN_WORKER}
    adopt_launch_environment(torchrun)
    assert torchrun == {**SRUN_TASK, **TORCHRUN_WORKER}
    bare: dict[str, str] = {}
    adopt_launch_environment(bare)
    assert bare == {}


@pytest.mark.parametrize(
    ("environ", "match"),
    [
        (
            {**SRUN_TASK, "WORLD_SIZE": "8"},
            "WORLD_SIZE: environment variable is 8 but srun started",
        ),
        (
            {**SRUN_TASK, "RANK": "0"},
            r"RANK: environment variable is 0 but srun started this task as SLURM_PROCID=3",
        ),
        ({**SRUN_TASK, "SLURM_JOB_ID": "abc"}, "SLURM_JOB_ID: is 'abc', not a job number"),
        (
            {**SRUN_TASK, "SLURM_STEP_NODELIST": "gpu[08-07]", "SLURM_JOB_NODELIST": "gpu[08-07]"},
            "runs backwards; set MASTER_ADDR",
        ),
        (
            {**SRUN_TASK, "SLURM_PROCID": "4"},
            r"SLURM_PROCID: is 4, outside \[0, SLURM_STEP_NUM_TASKS=4\)",
        ),
        ({"WORLD_SIZE": "2", "MASTER_ADDR": "n0", "MASTER_PORT": "1"}, "RANK is not set"),
        ({"WORLD_SIZE": "4", "RANK": "0"}, "MASTER_ADDR, MASTER_PORT are not set"),
        ({"RANK": "1"}, r"RANK: environment variable is 1, outside \[0, WORLD_SIZE=1\)"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE: environment variable is 0; it must be >= 1"),
        (
            {
                k: v
                for k, v in SRUN_TASK.items()
                if k not in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
            },
            "SLURM_STEP_NUM_TASKS: srun started this process .* neither",
        ),
        (
            {k: v for k, v in SRUN_TASK.items() if not k.endswith("_NODELIST")},
            "MASTER_ADDR: srun started 4 tasks but neither SLURM_STEP_NODELIST nor",
        ),
    ],
)
def test_launches_that_cannot_work_are_refused_naming_the_variables(
    environ: dict[str, str], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        launch_environment(environ)


def test_srun_variables_set_by_hand_that_agree_are_accepted() -> None:
    exported = {**SRUN_TASK, "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}
    assert launch_environment(exported) == launch_environment(SRUN_TASK)


def test_a_batch_script_without_srun_trains_alone_and_is_told_so() -> None:
    assert launch_environment(BATCH_STEP).launcher == "single"
    notice = launch_notice(BATCH_STEP)
    assert notice is not None and "holds 4 tasks (SLURM_NTASKS)" in notice
    assert "srun python -m bridge.train" in notice
    assert launch_notice(SRUN_TASK) is None
    assert launch_notice({**BATCH_STEP, "SLURM_NTASKS": "1"}) is None
    assert launch_notice({}) is None


def _one_of_two(rank: int) -> LaunchEnvironment:
    return launch_environment(
        {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(find_free_port()),
        }
    )


@pytest.mark.timeout(120)
def test_rank_0_whose_peers_never_come_says_so_then_fails_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    launch = _one_of_two(0)
    connect = lambda: dist.init_process_group(  # noqa: E731
        "gloo",
        init_method=f"tcp://{launch.address}",
        rank=0,
        world_size=2,
        timeout=timedelta(seconds=3),
    )
    with caplog.at_level(logging.WARNING), pytest.raises(RendezvousTimeout) as info:
        guarded_rendezvous(
            launch, connect, 3.0, rendezvous_errors=(dist.DistError,), notice_after=0.5
        )
    assert not dist.is_initialized()
    notices = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
    assert len(notices) == 1, caplog.text
    assert re.search(
        rf"^rank 0 has waited \d+ s for 2 ranks to meet at {launch.address} \(WORLD_SIZE=2 "
        r"from the environment, .*\); it gives up after 3 s \(dist.distributed_timeout_minutes\)$",
        notices[0],
    ), notices[0]
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("WORLD_SIZE, MASTER_ADDR, MASTER_PORT: rank 0 waited")
    assert "1/2 clients joined" in message  # torch's count of who came
    assert "start all 2 ranks" in message and "unset RANK, WORLD_SIZE" in message


@pytest.mark.timeout(120)
def test_rank_1_whose_master_never_listens_gives_up_without_torchs_retry_noise(
    caplog: pytest.LogCaptureFixture,
) -> None:
    launch = _one_of_two(1)
    calls: list[int] = []
    with caplog.at_level(logging.WARNING), pytest.raises(RendezvousTimeout) as info:
        guarded_rendezvous(launch, lambda: calls.append(1), 2.0, notice_after=0.5)
    assert calls == []  # torch's client was never started
    assert info.value.rank == 1
    assert f"rank 1 found no rendezvous at {launch.address} within 2 s" in str(info.value)
    assert "for rank 0's rendezvous" in caplog.text


def test_one_process_connects_without_a_guard() -> None:
    calls: list[int] = []
    guarded_rendezvous(launch_environment({}), lambda: calls.append(1), 1.0)
    assert calls == [1]


def test_the_command_reads_the_launch_without_importing_torch() -> None:
    probe = (
        "import sys; from bridge.train.engine.launch_env import launch_environment; "
        "launch_environment(); print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'megatron', 'core_utils')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out


# ------------------------------------------------------------------ dist.local_rank


def _launched_by(monkeypatch: pytest.MonkeyPatch, environ: dict[str, str]) -> None:
    """Make ``environ`` the process's launch variables (every other one removed)."""
    import os

    for name in list(os.environ):
        if name.startswith("SLURM_") or name in (*TORCHRUN_WORKER, "LOCAL_WORLD_SIZE"):
            monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)


def test_dist_local_rank_defaults_to_the_launchers_and_picks_the_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The default is the launch's local rank (torchrun's LOCAL_RANK; srun's SLURM_LOCALID
    before bridge-train exports it); the device is dist.local_rank modulo the visible
    devices (0 with external_gpu_device_mapping), a value set by hand where the launcher
    gives none included."""
    import torch

    from bridge.config import DistributedInitConfig
    from bridge.train.engine.initialize import select_cuda_device

    devices: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    for environ, local_rank in ((TORCHRUN_WORKER, 1), (SRUN_TASK, 1), ({}, 0)):
        _launched_by(monkeypatch, environ)
        assert DistributedInitConfig().local_rank == local_rank == launch_environment().local_rank
    _launched_by(monkeypatch, {**SRUN_TASK, "SLURM_LOCALID": "3"})
    select_cuda_device(DistributedInitConfig(), "nccl")
    _launched_by(monkeypatch, {})  # started bare: the value set by hand
    select_cuda_device(DistributedInitConfig(local_rank=6), "nccl")
    select_cuda_device(
        DistributedInitConfig(local_rank=6, external_gpu_device_mapping=True), "nccl"
    )
    select_cuda_device(DistributedInitConfig(local_rank=6), "gloo")  # no device with gloo
    assert devices == [3, 2, 0]


def test_a_local_rank_other_than_the_launchers_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every process of a node reads the same config, so where the launcher gives local
    ranks the field must be the launcher's; where it gives none, any value is this
    process's."""
    from bridge.config import DistributedInitConfig
    from bridge.train.checks.rules import local_rank_is_the_launchers
    from bridge.train.cli import EXIT_CONFIG_ERROR, main

    fix = (
        "and every process of a node reads the same value: remove dist.local_rank from the "
        "config (its default is the launcher's; a run_config.yaml saved by an earlier "
        "bridge-train holds rank 0's), or give each process its own GPU with "
        "CUDA_VISIBLE_DEVICES and dist.external_gpu_device_mapping=true"
    )
    for environ, origin in ((TORCHRUN_WORKER, "torchrun"), (SRUN_TASK, "SLURM_LOCALID=1")):
        _launched_by(monkeypatch, environ)
        local_rank_is_the_launchers(DistributedInitConfig())
        with pytest.raises(ConfigError) as info:
            local_rank_is_the_launchers(DistributedInitConfig(local_rank=0))
        assert str(info.value) == (
            "dist.local_rank: got 0, but this process is local rank 1 of its launch "
            f"(LOCAL_RANK from {origin}), {fix}"
        )
    for environ in ({}, {"RANK": "0", "WORLD_SIZE": "1"}):  # no local rank given
        _launched_by(monkeypatch, environ)
        local_rank_is_the_launchers(DistributedInitConfig(local_rank=3))
    # The command: one line, exit code 2, before anything starts.
    _launched_by(monkeypatch, {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    with pytest.raises(SystemExit) as exited:
        main(["--dry-run", "dist.distributed_backend=gloo", "dist.local_rank=1"])
    assert exited.value.code == EXIT_CONFIG_ERROR
    assert (
        "bridge-train: error: dist.local_rank: got 1, but this process is local rank 0 of "
        f"its launch (LOCAL_RANK from the environment), {fix}"
    ) in capsys.readouterr().err.splitlines()


def test_a_saved_run_config_gives_each_process_its_own_local_rank(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A run_config.yaml written before saved configs left ``dist.local_rank`` out holds the
    saving process's (rank 0's): loaded back (``--config``, ``--eval-only``'s own config) on
    another local rank, each process takes its launcher's, unless the command sets it."""
    import yaml

    from bridge.config import load_config
    from bridge.train.cli import _load, build_parser
    from bridge.train.recipes import DEFAULT_RECIPE, recipe_path

    data = yaml.safe_load(load_config(recipe_path(DEFAULT_RECIPE)).format_yaml())
    data.setdefault("dist", {})["local_rank"] = 0
    saved = tmp_path / "run_config.yaml"
    saved.write_text(yaml.safe_dump(data), encoding="utf-8")
    _launched_by(monkeypatch, {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})

    cfg, _, recipe_cfg = _load(
        build_parser().parse_args(["--config", str(saved), "train.train_iters=3"])
    )
    assert cfg.dist.local_rank == 1 and recipe_cfg.dist.local_rank == 1
    cfg, _, _ = _load(build_parser().parse_args(["--config", str(saved), "dist.local_rank=0"]))
    assert cfg.dist.local_rank == 0  # the command's own value is the user's: checked as given
    renamed = tmp_path / "recipe.yaml"
    renamed.write_text(saved.read_text(encoding="utf-8"), encoding="utf-8")
    cfg, _, _ = _load(build_parser().parse_args(["--config", str(renamed)]))
    assert cfg.dist.local_rank == 0  # a recipe file's value is the user's
