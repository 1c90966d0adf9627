"""Process-group start-up that survives ``torchrun --max-restarts`` restarts.

With torch 2.14, ``torchrun`` restarts a failed worker group against the *same* agent
TCPStore (``TORCHELASTIC_USE_AGENT_STORE=True``, same ``MASTER_PORT``), and gloo's
full-mesh connection set-up finds the addresses the previous attempt's ranks published
there: the restarted ranks try to connect to dead processes and ``init_process_group``
fails with ``Gloo connectFullMesh failed ... Connection refused`` (measured with both the
static and the c10d rendezvous). :func:`init_process_group` gives every attempt its own
key space in that store (``PrefixStore("bridge_attempt_<n>/")``), which makes restarts work.
Outside torchelastic, or when each attempt gets a fresh store (``ft_launcher``), it is a
plain ``torch.distributed.init_process_group``.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["init_process_group", "restart_count"]


def restart_count() -> int:
    """How many times the launcher restarted this worker group (0 without a launcher)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def init_process_group(
    backend: str = "gloo", *, timeout: timedelta = timedelta(minutes=10), **kwargs: Any
) -> None:
    """Initialise the default process group from the launcher's environment, restart-safe.

    Args:
        backend: ``"gloo"``, ``"nccl"`` or a mixed spec such as ``"cpu:gloo,cuda:nccl"``.
        timeout: Timeout of collectives (``dist.distributed_timeout_minutes``).
        **kwargs: Passed to ``torch.distributed.init_process_group`` (e.g. ``device_id``).

    Raises:
        ValueError: ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` are missing
            while ``TORCHELASTIC_USE_AGENT_STORE`` says a launcher set them.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        dist.init_process_group(backend, timeout=timeout, **kwargs)
        return
    missing = [
        k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
    if missing:
        raise ValueError(
            f"init_process_group: TORCHELASTIC_USE_AGENT_STORE is set but {missing} are not; "
            "start the job with torchrun or unset TORCHELASTIC_USE_AGENT_STORE"
        )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timeout,
    )
    store = dist.PrefixStore(f"bridge_attempt_{restart_count()}/", agent_store)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs
    )
