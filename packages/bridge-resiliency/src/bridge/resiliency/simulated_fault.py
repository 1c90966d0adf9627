"""Inject a real fault into one rank, to test that the job survives it.

``FaultToleranceConfig.simulate_fault`` switches this on. After
``simulated_fault_base_delay`` seconds plus a small random delay, a background thread on
the chosen rank either

* ``rank_killed``: sends the process ``SIGKILL`` (it dies at once, without cleanup), or
* ``rank_hung``: sends the process ``SIGSTOP`` (every thread stops; the process holds its
  sockets and memory but makes no progress, exactly like a rank stuck in a kernel or a
  deadlock).

Just before, it prints a banner to stdout and stderr naming the fault, the rank and the
wall-clock time (``at unix time <seconds>``).

A killed rank is noticed by the launcher (``torchrun``/``ft_launcher`` restart the workers
when ``--max-restarts`` allows). A hung rank is noticed only by a progress monitor: the
nvidia-resiliency-ext rank monitor, the built-in :class:`~bridge.resiliency.HangWatchdog`,
or, last, the process-group timeout of the other ranks' next collective.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

from bridge.config import FaultToleranceConfig
from bridge.resiliency._dist import broadcast_int
from bridge.resiliency.errors import ResiliencyError
from core_utils.distributed import global_rank, global_world_size

__all__ = ["FaultType", "SimulatedFault"]

FaultType = Literal["rank_hung", "rank_killed"]

_FAULT_SIGNALS: dict[str, signal.Signals] = {
    "rank_hung": signal.SIGSTOP,
    "rank_killed": signal.SIGKILL,
}


def extra_delay_bound(base_delay: float) -> float:
    """Upper bound of the random delay added to ``base_delay``: 10 % of it plus 1 s."""
    return 0.1 * base_delay + 1.0


@dataclass
class SimulatedFault:
    """A fault scheduled on one rank of the job.

    Build it with :meth:`from_config` (which agrees on the rank across the job), then call
    :meth:`start` on every rank once training begins; only the chosen rank starts the
    fault thread.

    Attributes:
        fault_type: ``"rank_hung"`` or ``"rank_killed"`` (``"random"`` is resolved by
            :meth:`from_config`).
        target_rank: The global rank the fault hits.
        delay: Seconds from :meth:`start` until the fault.
        rank: This process's global rank.
    """

    fault_type: FaultType
    target_rank: int
    delay: float
    rank: int
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.fault_type not in _FAULT_SIGNALS:
            raise ResiliencyError(
                f"SimulatedFault.fault_type: got {self.fault_type!r}; expected 'rank_hung' or "
                "'rank_killed'"
            )
        if self.delay < 0:
            raise ResiliencyError(f"SimulatedFault.delay: got {self.delay}; expected >= 0 s")

    @classmethod
    def from_config(
        cls,
        config: FaultToleranceConfig | None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        seed: int | None = None,
    ) -> SimulatedFault | None:
        """Resolve the configured fault for this job, or return ``None`` when it is off.

        When ``simulated_fault_rank`` is unset, rank 0 draws the target rank and broadcasts
        it, so this is a collective over the default process group in that case (call it on
        every rank). ``simulated_fault_type="random"`` picks ``rank_hung`` or
        ``rank_killed`` with equal probability. The delay is
        ``simulated_fault_base_delay + uniform(0, 0.1 * base + 1)`` seconds.

        Args:
            config: The ``ft`` section (``None`` or ``simulate_fault=False``: no fault).
            rank: This process's global rank (default: torch.distributed's, else ``$RANK``).
            world_size: World size (default: torch.distributed's, else ``$WORLD_SIZE``).
            seed: Seed of the random choices (default: fresh randomness).

        Returns:
            The fault, or ``None`` if no fault is configured.

        Raises:
            ResiliencyError: ``simulated_fault_rank`` is not a rank of this job.
        """
        if config is None or not config.simulate_fault:
            return None
        rank = global_rank(launcher_fallback=True) if rank is None else rank
        world_size = global_world_size(launcher_fallback=True) if world_size is None else world_size
        rng = random.Random(seed)
        target = config.simulated_fault_rank
        if target is None:
            target = broadcast_int(rng.randrange(world_size), src=0)
        if not 0 <= target < world_size:
            raise ResiliencyError(
                f"ft.simulated_fault_rank: got {target}; the job has ranks 0 to "
                f"{world_size - 1}. Choose one of them or unset it for a random rank."
            )
        fault_type: FaultType
        if config.simulated_fault_type == "random":
            fault_type = rng.choice(("rank_hung", "rank_killed"))
        else:
            fault_type = config.simulated_fault_type
        base = float(config.simulated_fault_base_delay)
        delay = base + rng.uniform(0.0, extra_delay_bound(base))
        return cls(fault_type=fault_type, target_rank=target, delay=delay, rank=rank)

    @property
    def is_target(self) -> bool:
        """Whether this process is the rank the fault hits."""
        return self.rank == self.target_rank

    @property
    def started(self) -> bool:
        """Whether :meth:`start` scheduled the fault on this rank."""
        return self._thread is not None

    def start(self) -> None:
        """Schedule the fault in a daemon thread if this is the target rank (idempotent)."""
        if not self.is_target or self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._inject, name="bridge-simulated-fault", daemon=True
        )
        self._thread.start()

    def _inject(self) -> None:
        time.sleep(self.delay)
        # The wall-clock time is when the rank stops making progress: detection latencies
        # (rank monitor, watchdog, launcher) are measured from it.
        banner = (
            f"\n#### bridge.resiliency: simulating fault {self.fault_type!r} on rank "
            f"{self.rank} (pid {os.getpid()}) after {self.delay:.2f} s, at unix time "
            f"{time.time():.3f} ####\n"
        )
        for stream in (sys.stdout, sys.stderr):
            print(banner, file=stream, flush=True)
        os.kill(os.getpid(), _FAULT_SIGNALS[self.fault_type])
