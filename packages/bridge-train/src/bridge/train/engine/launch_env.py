"""Launch environments: which launcher started this process, and where its ranks meet.

Three launchers are first-class, read in this order (the first that applies wins; the
variables each one reads are listed in ``docs/clusters.md``):

1. **torch's variables**, as ``torchrun`` sets them or a script exports them by hand. They
   win over SLURM's, so ``srun torchrun ...`` keeps working.
2. **SLURM's** ``srun`` without torchrun. The master address is the first host of the step's
   (else the job's) node list; the port is ``10000 + SLURM_JOB_ID % 20000``: below Linux's
   ephemeral range, and the same on every node of the job without any exchange, as
   Megatron-LM's and Lightning's SLURM launches derive theirs. ``MASTER_ADDR`` and
   ``MASTER_PORT``, when set, override both. Only a process that ``srun`` started counts
   (``SLURM_STEP_ID`` is set): the batch script itself runs outside any step, and a
   ``python -m bridge.train`` run there trains alone (:func:`launch_notice` says so).
3. **One process**, started bare: rank 0 of 1.

:func:`adopt_launch_environment` exports an ``srun`` launch as torch's variables before
anything reads them, so that every reader (torch's ``env://`` rendezvous, core-utils,
bridge-config's world size, the resiliency tools, child processes) sees one view; it is a
pure function of the environment, so calling it again (the CLI, ``pretrain``,
``pretrain_mimo``, ``initialize_distributed``) changes nothing.

Environments that cannot be a real launch are refused at once with a
:class:`~bridge.config.ConfigError` naming the variables and the fix. What cannot be seen
from one process (a ``WORLD_SIZE`` larger than the ranks that were started, a master
address no rank 0 listens on) is caught by :func:`guarded_rendezvous`.

Nothing here imports torch: the CLI reads the launcher's view before deciding to.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Literal

from bridge.config import ConfigError

__all__ = [
    "LaunchEnvironment",
    "RendezvousTimeout",
    "adopt_launch_environment",
    "expand_hostlist",
    "first_host",
    "guarded_rendezvous",
    "launch_environment",
    "launch_notice",
    "slurm_master_port",
]

logger = logging.getLogger(__name__)

Launcher = Literal["single", "torchrun", "environment", "slurm"]

# Variables torchrun's agent sets for every worker it starts.
_TORCHRUN_MARKERS = ("TORCHELASTIC_RUN_ID", "GROUP_RANK", "LOCAL_WORLD_SIZE")
# What any launcher of several processes must provide for torch's env:// rendezvous.
_RENDEZVOUS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK")
# What adopt_launch_environment exports (torch's names).
_EXPORTED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
SLURM_PORT_BASE, SLURM_PORT_SPAN = 10000, 20000
# Seconds a rank waits at the rendezvous before it says what it waits for.
NOTICE_AFTER_SECONDS = 5.0


@dataclass(frozen=True)
class LaunchEnvironment:
    """This process's place in the launch, and where the ranks meet.

    Attributes:
        launcher: ``"single"`` (started bare), ``"torchrun"``, ``"environment"`` (torch's
            variables exported by a script or another launcher) or ``"slurm"`` (``srun``
            without torchrun).
        rank: Global rank.
        world_size: Number of ranks.
        local_rank: Rank on this node.
        master_addr: Host of rank 0's rendezvous store (``None`` for one process).
        master_port: Its port (``None`` for one process).
        origins: For each of torch's variables, where its value came from, for messages
            (``"SLURM_STEP_NUM_TASKS=4"``, ``"the first host of SLURM_JOB_NODELIST=n[1-2]"``);
            ``LOCAL_RANK`` only where the launcher gives this process a local rank.
    """

    launcher: Launcher
    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None = None
    master_port: int | None = None
    origins: Mapping[str, str] = field(default_factory=dict)

    @property
    def distributed(self) -> bool:
        """Whether the ranks meet at a rendezvous (``MASTER_ADDR``/``MASTER_PORT`` known)."""
        return self.master_addr is not None and self.master_port is not None

    @property
    def address(self) -> str:
        """``host:port`` of the rendezvous (``"-"`` for one process)."""
        return f"{self.master_addr}:{self.master_port}" if self.distributed else "-"

    def variables(self) -> dict[str, str]:
        """torch's variables for this launch (what :func:`adopt_launch_environment` exports)."""
        values = {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
        }
        if self.distributed:
            values["MASTER_ADDR"] = str(self.master_addr)
            values["MASTER_PORT"] = str(self.master_port)
        return values

    def sources(self) -> str:
        """Where the values came from, as ``WORLD_SIZE=4 from SLURM_STEP_NUM_TASKS, ...``."""
        values = self.variables()
        return ", ".join(
            f"{name}={values[name]} from {self.origins.get(name, 'the environment')}"
            for name in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
            if name in values
        )


class RendezvousTimeout(ConfigError):
    """The ranks did not all meet within ``dist.distributed_timeout_minutes``.

    A :class:`~bridge.config.ConfigError` (the launch environment is the run's input): the
    command prints it as one line, on every rank, and exits with code 2.

    Attributes:
        rank: The rank that gave up.
    """

    def __init__(self, location: str, detail: str, *, rank: int) -> None:
        super().__init__(location, detail)
        self.rank = rank


# --------------------------------------------------------------------------- host lists

_BRACKET = re.compile(r"\[([^\[\]]*)\]")
# A host name: characters other than separators and brackets, and whole bracket groups.
_NAME = re.compile(r"(?:\[[^\[\]]*\]|[^\s,\[\]])+")


def _expand_ranges(body: str, text: str) -> list[str]:
    values: list[str] = []
    for part in body.split(","):
        part = part.strip()
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"invalid host list {text!r}: {part!r} is not a number or a range")
        if not dash:
            values.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"invalid host list {text!r}: range {part!r} runs backwards")
        width = len(low)  # node[08-11]: node08 ... node11; node[8-11]: node8 ... node11
        values.extend(f"{number:0{width}d}" for number in range(int(low), int(high) + 1))
    return values


def expand_hostlist(text: str) -> list[str]:
    """Expand SLURM's host-list syntax (``SLURM_JOB_NODELIST``) into host names, in order.

    ``node[01-04,07],gpu[1-2]`` gives ``node01 node02 node03 node04 node07 gpu1 gpu2``;
    zero padding follows the range's lower bound, several bracket groups in one name
    multiply (``rack[1-2]-n[1-3]``: the first group varies slowest), as ``scontrol show
    hostnames`` expands them.

    Raises:
        ValueError: Unbalanced brackets, a range that runs backwards, or a non-number.
    """
    # What no name matches is a separator (comma, whitespace), or a stray bracket.
    if _NAME.sub("", text).replace(",", " ").strip():
        raise ValueError(f"invalid host list {text!r}: unbalanced brackets")
    hosts: list[str] = []
    for name in _NAME.findall(text):
        # Literal text at even indices, bracket bodies at odd ones; product() varies the
        # first group slowest.
        parts = _BRACKET.split(name)
        choices = [_expand_ranges(p, text) if i % 2 else [p] for i, p in enumerate(parts)]
        hosts.extend("".join(host) for host in itertools.product(*choices))
    return hosts


@functools.lru_cache(maxsize=8)
def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list (``SLURM_JOB_NODELIST``).

    ``scontrol show hostnames`` expands it where ``scontrol`` exists (SLURM's own rules for
    every syntax it accepts); otherwise, or when it fails, :func:`expand_hostlist` does.

    Raises:
        ValueError: The list is empty or invalid.
    """
    scontrol = shutil.which("scontrol")
    if scontrol is not None:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            result = subprocess.run(
                [scontrol, "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                timeout=20,
                check=False,
            )
            hosts = result.stdout.split()
            if result.returncode == 0 and hosts and "Invalid" not in result.stdout + result.stderr:
                return hosts[0]
    hosts = expand_hostlist(nodelist)
    if not hosts:
        raise ValueError(f"the host list {nodelist!r} is empty")
    return hosts[0]


def slurm_master_port(job_id: str) -> int:
    """The rendezvous port of a SLURM job: ``10000 + job_id % 20000`` (module docstring).

    Two jobs collide only when their ids differ by a multiple of 20000 and they share rank
    0's node (``MASTER_PORT`` overrides it).
    """
    return SLURM_PORT_BASE + int(job_id) % SLURM_PORT_SPAN


# --------------------------------------------------------------------------- detection


def _int_variable(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(
            name, f"environment variable holds {raw!r}, not an integer; unset it or fix it"
        ) from None


def _srun_task(environ: Mapping[str, str]) -> bool:
    """Whether ``srun`` started this process (it runs inside a job step)."""
    return ("SLURM_STEP_ID" in environ or "SLURM_STEPID" in environ) and "SLURM_PROCID" in environ


def _torch_launch(environ: Mapping[str, str], torchrun: bool) -> LaunchEnvironment:
    """torch's variables, refused when they cannot be a real launch (module docstring)."""
    world = _int_variable(environ, "WORLD_SIZE")
    rank = _int_variable(environ, "RANK")
    if world is not None and world < 1:
        raise ConfigError("WORLD_SIZE", f"environment variable is {world}; it must be >= 1")
    if rank is not None and not 0 <= rank < (world or 1):
        raise ConfigError(
            "RANK",
            f"environment variable is {rank}, outside [0, WORLD_SIZE={world or 1}); unset "
            "RANK and WORLD_SIZE for a one-process run, or launch with torchrun or srun",
        )
    missing = [name for name in _RENDEZVOUS_VARIABLES if not environ.get(name)]
    if world is not None and world > 1 and not torchrun and missing:
        raise ConfigError(
            "WORLD_SIZE",
            f"environment variable is {world} but this is not a torchrun launch and "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set, so the "
            "other ranks would never join; unset WORLD_SIZE and RANK for a one-process run "
            f"(env -u WORLD_SIZE -u RANK bridge-train ...), or launch with torchrun "
            f"--nproc_per_node={world} (or srun, which bridge-train reads by itself)",
        )
    local_rank = _int_variable(environ, "LOCAL_RANK")
    master_port = _int_variable(environ, "MASTER_PORT")
    master_addr = environ.get("MASTER_ADDR") or None
    origins = dict.fromkeys(_EXPORTED, "torchrun" if torchrun else "the environment")
    if local_rank is None:  # nothing gives this process a local rank (dist.local_rank may)
        del origins["LOCAL_RANK"]
    return LaunchEnvironment(
        launcher="torchrun" if torchrun else "environment",
        rank=rank or 0,
        world_size=world or 1,
        local_rank=local_rank if local_rank is not None else 0,
        # Only both make a rendezvous (a one-rank launch may leave them out).
        master_addr=master_addr if master_port is not None else None,
        master_port=master_port if master_addr is not None else None,
        origins=origins,
    )


def _slurm_launch(environ: Mapping[str, str]) -> LaunchEnvironment:
    """An ``srun`` task's launch, from SLURM's variables (module docstring)."""
    world_name = next(
        (name for name in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") if name in environ), None
    )
    if world_name is None:
        raise ConfigError(
            "SLURM_STEP_NUM_TASKS",
            "srun started this process (SLURM_PROCID and SLURM_STEP_ID are set) but neither "
            "SLURM_STEP_NUM_TASKS nor SLURM_NTASKS says how many tasks it started; launch with "
            "srun as documented in docs/clusters.md, or set WORLD_SIZE, RANK, MASTER_ADDR and "
            "MASTER_PORT yourself",
        )
    world = int(_int_variable(environ, world_name) or 0)
    rank = _int_variable(environ, "SLURM_PROCID") or 0
    local_rank = _int_variable(environ, "SLURM_LOCALID") or 0
    # torch's variables set by hand inside an srun task must match what srun started.
    for name, slurm_value, slurm_name in (
        ("WORLD_SIZE", world, world_name),
        ("RANK", rank, "SLURM_PROCID"),
    ):
        value = _int_variable(environ, name)
        if value is not None and value != slurm_value:
            raise ConfigError(
                name,
                f"environment variable is {value} but srun started this task as "
                f"{slurm_name}={slurm_value}; the ranks would wait for each other forever. "
                f"Unset {name} (and RANK, WORLD_SIZE, LOCAL_RANK) in the batch script: "
                "bridge-train reads srun's variables by itself (docs/clusters.md)",
            )
    if not 0 <= rank < world:
        raise ConfigError(
            "SLURM_PROCID",
            f"is {rank}, outside [0, {world_name}={world}); this is not a task srun started: "
            "unset the SLURM_* variables or launch with srun",
        )
    origins = {
        "RANK": f"SLURM_PROCID={rank}",
        "WORLD_SIZE": world_name,
        "LOCAL_RANK": f"SLURM_LOCALID={local_rank}",
    }
    if world == 1:
        return LaunchEnvironment("slurm", rank, world, local_rank, origins=origins)
    list_name = next(
        (name for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST") if environ.get(name)),
        None,
    )
    derived_addr: str | None = None
    if list_name is not None:
        try:
            derived_addr = first_host(environ[list_name])
        except ValueError as exc:
            if not environ.get("MASTER_ADDR"):
                raise ConfigError(
                    list_name, f"{exc}; set MASTER_ADDR to the host of rank 0"
                ) from None
    master_addr = environ.get("MASTER_ADDR") or derived_addr
    if master_addr is None:
        raise ConfigError(
            "MASTER_ADDR",
            f"srun started {world} tasks but neither SLURM_STEP_NODELIST nor "
            "SLURM_JOB_NODELIST names their hosts; set MASTER_ADDR to the host of rank 0",
        )
    origins["MASTER_ADDR"] = (
        f"the first host of {list_name}={environ[list_name]}"
        if list_name is not None and master_addr == derived_addr
        else "MASTER_ADDR set in the environment"
    )
    job_id = environ.get("SLURM_JOB_ID", "")
    derived_port = slurm_master_port(job_id) if job_id.isdigit() else None
    master_port = _int_variable(environ, "MASTER_PORT") or derived_port
    if master_port is None:
        raise ConfigError(
            "SLURM_JOB_ID",
            f"is {job_id!r}, not a job number, so no rendezvous port can be derived from it; "
            "set MASTER_PORT (the same on every task)",
        )
    origins["MASTER_PORT"] = (
        f"SLURM_JOB_ID={job_id} ({SLURM_PORT_BASE} + job id % {SLURM_PORT_SPAN})"
        if master_port == derived_port
        else "MASTER_PORT set in the environment"
    )
    return LaunchEnvironment(
        "slurm", rank, world, local_rank, master_addr, master_port, origins=origins
    )


def launch_environment(environ: Mapping[str, str] | None = None) -> LaunchEnvironment:
    """Read the launch environment (see the module docstring for the rules).

    Args:
        environ: The process environment (default ``os.environ``).

    Returns:
        The launch as the variables describe it.

    Raises:
        ConfigError: The variables cannot be a real launch (a ``WORLD_SIZE`` > 1 without a
            master address or rank outside torchrun, a ``RANK`` outside the world, values
            set by hand inside an ``srun`` task that disagree with what ``srun`` started, a
            non-integer value); the message names the variables and the fix.
    """
    environ = os.environ if environ is None else environ
    torchrun = any(name in environ for name in _TORCHRUN_MARKERS)
    if _srun_task(environ) and not torchrun:
        return _slurm_launch(environ)
    if "RANK" in environ or "WORLD_SIZE" in environ or torchrun:
        return _torch_launch(environ, torchrun)
    return LaunchEnvironment("single", 0, 1, 0)


def adopt_launch_environment(environ: MutableMapping[str, str] | None = None) -> LaunchEnvironment:
    """Read the launch environment and export an ``srun`` launch as torch's variables
    (module docstring); other launches are left as they are.

    Args:
        environ: The environment to read and update (default ``os.environ``).

    Raises:
        ConfigError: As :func:`launch_environment`.
    """
    target = os.environ if environ is None else environ
    launch = launch_environment(target)
    if launch.launcher == "slurm":
        target.update(launch.variables())
    return launch


def launch_notice(environ: Mapping[str, str] | None = None) -> str | None:
    """A one-line warning (else ``None``) for a launch that trains alone although SLURM
    allocated more: a ``python -m bridge.train`` line in a batch script, run without
    ``srun``, starts one process in the batch step while the job holds ``SLURM_NTASKS`` tasks.

    Args:
        environ: The process environment (default ``os.environ``).
    """
    environ = os.environ if environ is None else environ
    if "SLURM_JOB_ID" not in environ or _srun_task(environ):
        return None
    if "RANK" in environ or "WORLD_SIZE" in environ:
        return None
    tasks = environ.get("SLURM_NTASKS", "1")
    if not tasks.isdigit() or int(tasks) < 2:
        return None
    return (
        f"SLURM job {environ['SLURM_JOB_ID']} holds {tasks} tasks (SLURM_NTASKS) but this "
        "process was not started by srun, so it trains alone; start it with "
        "`srun python -m bridge.train ...` (examples/slurm/)"
    )


# --------------------------------------------------------------------------- rendezvous


def _fix(launch: LaunchEnvironment) -> str:
    if launch.launcher == "slurm":
        return (
            f"check that every one of the {launch.world_size} tasks srun started is running, "
            f"that {launch.master_addr} is the host of rank 0 and reachable from every node "
            "(else set MASTER_ADDR) and that the port is free on it (else set MASTER_PORT)"
        )
    if launch.launcher == "torchrun":
        return "check that every torchrun agent started its workers and that the nodes reach each other"
    return (
        f"start all {launch.world_size} ranks with these variables (or use torchrun "
        f"--nproc_per_node={launch.world_size}, or srun), or unset RANK, WORLD_SIZE, "
        "MASTER_ADDR and MASTER_PORT for a one-process run"
    )


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2.0):
            return True
    except OSError:
        return False


def _announce(launch: LaunchEnvironment, waited: float, timeout: float) -> None:
    what = (
        f"for {launch.world_size} ranks to meet at {launch.address}"
        if launch.rank == 0
        else f"for rank 0's rendezvous at {launch.address}"
    )
    logger.warning(
        "rank %d has waited %.0f s %s (%s); it gives up after %.0f s "
        "(dist.distributed_timeout_minutes)",
        launch.rank,
        waited,
        what,
        launch.sources(),
        timeout,
    )


def guarded_rendezvous(
    launch: LaunchEnvironment,
    connect: Callable[[], None],
    timeout: float,
    *,
    rendezvous_errors: tuple[type[BaseException], ...] = (),
    notice_after: float = NOTICE_AFTER_SECONDS,
) -> None:
    """Run ``connect`` (the process-group set-up) so that a stuck rendezvous never waits silently.

    A rank other than 0 first waits until rank 0's address accepts connections (torch's
    own client retries would otherwise print a C++ stack per attempt). After
    ``notice_after`` seconds of waiting, rank 0 and the first rank of every node log what
    they wait for: how many ranks, which address and port, which variables set them.
    After ``timeout`` seconds, or when ``connect`` raises one of ``rendezvous_errors``
    (torch's store time-outs), :class:`RendezvousTimeout` says so in one line.

    Args:
        launch: The launch (:func:`launch_environment`).
        connect: Sets up the process group (raises on its own timeout).
        timeout: Seconds to wait in all (``dist.distributed_timeout_minutes``).
        rendezvous_errors: Exceptions of ``connect`` that mean the ranks did not meet.
        notice_after: Seconds before the waiting line.

    Raises:
        RendezvousTimeout: The ranks did not meet.
    """
    if not launch.distributed or launch.world_size == 1:
        connect()
        return
    start = time.monotonic()
    notice = threading.Timer(
        notice_after, lambda: _announce(launch, time.monotonic() - start, timeout)
    )
    notice.daemon = True
    if launch.rank == 0 or launch.local_rank == 0:  # the ones that say what they wait for
        notice.start()
    variables = "WORLD_SIZE, MASTER_ADDR, MASTER_PORT"
    try:
        if launch.rank != 0:
            assert launch.master_addr is not None and launch.master_port is not None
            while not _reachable(launch.master_addr, launch.master_port):
                if time.monotonic() - start > timeout:
                    raise RendezvousTimeout(
                        variables,
                        f"rank {launch.rank} found no rendezvous at {launch.address} within "
                        f"{timeout:.0f} s (dist.distributed_timeout_minutes; "
                        f"{launch.sources()}): {_fix(launch)}",
                        rank=launch.rank,
                    )
                time.sleep(0.5)
        try:
            connect()
        except rendezvous_errors as exc:
            raise RendezvousTimeout(
                variables,
                f"rank {launch.rank} waited {time.monotonic() - start:.0f} s at "
                f"{launch.address} for {launch.world_size} ranks and they did not all come "
                f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}; "
                f"{launch.sources()}): {_fix(launch)}",
                rank=launch.rank,
            ) from None
    finally:
        notice.cancel()
