"""A real SLURM on this machine for the tests: slurmctld and two slurmd "nodes" in a temp dir.

Debian 12's ``slurm-wlm`` (22.05) runs here with ``AuthType=auth/none`` (no munge daemon
needed), a ``slurm.conf`` of its own (``SLURM_CONF``), ports of its own, and two slurmd on
one host: the node named after the host and a node named ``localhost`` (its
``NodeHostname`` is the host), 2 CPUs each. Both names resolve to this machine, so a job's
tasks meet at the first host of its node list as on a real cluster. (Two nodes also
named after the host, ``n1`` / ``n2``, start too, but their names do not resolve; 22.05
refuses some orders of these lines with "Duplicated NodeHostName", so the order below is
the one measured to start.)

:func:`slurm_cluster` starts it and always stops it: jobs cancelled, daemons ended by their
own pid files, leftover job processes killed. ``.ci/run`` installs the packages; without them
:func:`require_slurm` skips the SLURM tests, or fails them when ``BRIDGE_REQUIRE_SLURM=1``
(CI sets it) says SLURM must be there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from core_utils.testing import find_free_port

__all__ = ["SlurmCluster", "require_slurm", "slurm_cluster"]

_PROGRAMS = ("slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")


def require_slurm() -> None:
    """Skip (or, with ``BRIDGE_REQUIRE_SLURM=1``, fail) unless SLURM can run here."""
    missing = [program for program in _PROGRAMS if shutil.which(program) is None]
    reason = None
    if missing:
        reason = (
            f"SLURM is not installed ({', '.join(missing)} missing): "
            "apt-get install slurm-wlm (as .ci/run does)"
        )
    elif os.geteuid() != 0:
        reason = "the test cluster's slurmctld/slurmd run as root (SlurmUser=root)"
    if reason is None:
        return
    if os.environ.get("BRIDGE_REQUIRE_SLURM") == "1":
        pytest.fail(f"BRIDGE_REQUIRE_SLURM=1 but {reason}")
    pytest.skip(reason)


@dataclass
class SlurmCluster:
    """A running test cluster.

    Attributes:
        directory: Its temp directory (config, state, logs).
        nodes: The node names, in the order SLURM gives them to a job.
        env: The environment for SLURM commands (``SLURM_CONF`` set).
    """

    directory: Path
    nodes: tuple[str, ...]
    env: dict[str, str]

    def command(self, *args: str, check: bool = True) -> str:
        """Run a SLURM command against this cluster; return its stdout."""
        result = subprocess.run(
            list(args), env=self.env, capture_output=True, text=True, timeout=60, check=False
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({result.returncode}): {result.stderr}")
        return result.stdout

    def sbatch(
        self,
        script: Path,
        options: Sequence[str],
        args: Sequence[str],
        env: dict[str, str],
        cwd: Path,
    ) -> int:
        """Submit ``script`` with ``options`` (sbatch's) and ``args`` (the script's); the job id."""
        result = subprocess.run(
            ["sbatch", "--parsable", *options, str(script), *args],
            env={**env, "SLURM_CONF": self.env["SLURM_CONF"]},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"sbatch failed ({result.returncode}): {result.stderr}")
        return int(result.stdout.strip().split(";")[0])

    def job(self, job: int) -> dict[str, str] | None:
        """``scontrol show job``'s fields of a job; ``None`` when slurmctld does not answer
        (a busy machine), so that no caller mistakes a slow answer for a finished job."""
        result = subprocess.run(
            ["scontrol", "show", "job", "-o", str(job)],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if result.returncode != 0:
            return None
        return dict(item.split("=", 1) for item in result.stdout.split() if "=" in item)

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the daemons' logs, for failure messages."""
        parts = []
        for log in sorted((self.directory / "log").glob("*.log")):
            parts.append(f"--- {log.name}\n{log.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)


def _config(directory: Path, host: str, nodes: Sequence[str]) -> str:
    ports = {name: find_free_port() for name in ("ctld", *nodes)}
    lines = [
        "ClusterName=bridgetest",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ports['ctld']}",
        "AuthType=auth/none",
        "CredType=cred/none",
        # A requeued job waits cred_expire + 1 s (reason BeginTime) before it may start
        # again: the default 120 s would idle the test. Releasing it earlier by hand
        # (scontrol update StartTime=now) fails: slurmd still refuses the job id's revoked
        # credential ("Killing non-startable batch job: Job credential revoked").
        "AuthInfo=cred_expire=10",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={directory}/state",
        f"SlurmdSpoolDir={directory}/spool/%n",
        f"SlurmctldPidFile={directory}/slurmctld.pid",
        f"SlurmdPidFile={directory}/slurmd.%n.pid",
        f"SlurmctldLogFile={directory}/log/slurmctld.log",
        f"SlurmdLogFile={directory}/log/slurmd.%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "JobRequeue=1",
        "ReturnToService=2",
        "MpiDefault=none",
        "MailProg=/bin/true",
        # Finished jobs stay visible to `scontrol show job` for the whole test session, and
        # commands wait for a slurmctld that a loaded machine answers slowly.
        "MinJobAge=3600",
        "MessageTimeout=60",
    ]
    for name in nodes:
        hostname = "" if name == host else f" NodeHostname={host}"
        lines.append(
            f"NodeName={name}{hostname} NodeAddr=127.0.0.1 Port={ports[name]} CPUs=2 "
            "RealMemory=4000 State=UNKNOWN"
        )
    lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def _stop(cluster: SlurmCluster) -> None:
    with contextlib.suppress(Exception):
        cluster.command("scancel", "--user=root", check=False)
        deadline = time.monotonic() + 30
        while cluster.command("squeue", "-h", check=False).strip() and time.monotonic() < deadline:
            time.sleep(0.5)
    for pid_file in cluster.directory.glob("*.pid"):
        with contextlib.suppress(ValueError, OSError):
            pid = int(pid_file.read_text().strip())
            if psutil.pid_exists(pid) and "slurm" in psutil.Process(pid).name():
                os.kill(pid, signal.SIGTERM)
                with contextlib.suppress(psutil.Error):
                    psutil.Process(pid).wait(timeout=20)
    # Anything a job left behind (its tasks name this directory or the cluster's config).
    marker = str(cluster.directory)
    for process in psutil.process_iter(["pid", "cmdline", "environ"]):
        with contextlib.suppress(psutil.Error):
            cmdline = " ".join(process.info.get("cmdline") or [])
            conf = (process.info.get("environ") or {}).get("SLURM_CONF", "")
            if process.pid != os.getpid() and (marker in cmdline or conf.startswith(marker)):
                process.kill()


@contextlib.contextmanager
def slurm_cluster(directory: Path) -> Iterator[SlurmCluster]:
    """Start slurmctld and the slurmd nodes in ``directory``; stop them on exit.

    Raises:
        RuntimeError: The cluster did not come up within 60 s (with the daemons' logs).
    """
    host = socket.gethostname().split(".")[0]
    nodes = (host,) if host == "localhost" else (host, "localhost")
    for sub in ("state", "log", *(f"spool/{n}" for n in nodes)):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    conf = directory / "slurm.conf"
    conf.write_text(_config(directory, host, nodes))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    cluster = SlurmCluster(directory, tuple(sorted(nodes)), env)
    try:
        cluster.command("slurmctld", "-i")
        for name in nodes:
            cluster.command("slurmd", "-N", name)
        deadline = time.monotonic() + 60
        while True:
            states = cluster.command("sinfo", "-h", "-N", "-o", "%N %T", check=False).split()
            if states.count("idle") == len(nodes):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the test SLURM cluster did not come up (sinfo: {states}):\n{cluster.log_tail()}"
                )
            time.sleep(0.5)
        yield cluster
    finally:
        _stop(cluster)
