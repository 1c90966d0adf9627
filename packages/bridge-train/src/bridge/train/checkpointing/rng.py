"""Random-number-generator state of one rank, saved per rank and restored on request.

Each rank stores its own generators (Python ``random``, NumPy's global generator, torch's
CPU generator, with CUDA every device generator, and megatron's tensor-parallel RNG
tracker when it is seeded, with CUDA or under the CUDA emulation on CPU) as a megatron ``ShardedObject`` at its global rank. The content is tensors and
plain Python values only, so it loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch
from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from core_utils.distributed import global_rank, global_world_size

__all__ = ["RNG_STATE_KEY", "capture_rng_state", "restore_rng_state", "rng_sharded_object"]

RNG_STATE_KEY = "rng_state"

logger = logging.getLogger(__name__)


def capture_rng_state() -> dict[str, Any]:
    """This process's generator states (see the module docstring for what is included)."""
    version, internal, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "random_rng_state": {
            "version": int(version),
            "state": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
        "np_rng_state": {
            "bit_generator": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": None,
        "rng_tracker_states": None,
    }
    if torch.cuda.is_available():
        state["cuda_rng_state"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    tracker_states = tensor_parallel.get_cuda_rng_tracker().get_states()
    if tracker_states:  # megatron's tensor-parallel RNG tracker, once seeded
        # Also without CUDA: under core-utils' CUDA emulation (the megatron engine on CPU)
        # the tracker holds CPU generator states, which dropout in tensor-parallel regions
        # draws from, so a resume is exact only with them.
        state["rng_tracker_states"] = {name: value.cpu() for name, value in tracker_states.items()}
        state["rng_tracker_device"] = _tracker_device()
    return state


def _tracker_device() -> str:
    """Which generators the tracker's states belong to: CUDA's (Philox) or the CPU's."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set this process's generators to ``state`` (from :func:`capture_rng_state`).

    CUDA generators are restored only when the state has them and CUDA is available;
    megatron's tensor-parallel RNG tracker when the state has it and it was saved with the
    same kind of generators (CUDA, or CPU under the CUDA emulation).
    """
    saved_random = state["random_rng_state"]
    random.setstate(
        (
            int(saved_random["version"]),
            tuple(int(x) for x in saved_random["state"].tolist()),
            saved_random["gauss_next"],
        )
    )
    saved_np = state["np_rng_state"]
    np.random.set_state(
        (
            saved_np["bit_generator"],
            saved_np["keys"].numpy().astype(np.uint32),
            int(saved_np["pos"]),
            int(saved_np["has_gauss"]),
            float(saved_np["cached_gaussian"]),
        )
    )
    torch.set_rng_state(state["torch_rng_state"].to(torch.uint8).cpu())
    if torch.cuda.is_available() and state.get("cuda_rng_state") is not None:
        torch.cuda.set_rng_state_all(state["cuda_rng_state"])
    tracker_states = state.get("rng_tracker_states")
    if tracker_states is not None:
        # Checkpoints from before the device was recorded hold CUDA states.
        saved_device = state.get("rng_tracker_device", "cuda")
        if saved_device != _tracker_device():
            logger.warning(
                "not restoring megatron's tensor-parallel RNG tracker: it was saved with %s "
                "generators and this run uses %s generators",
                saved_device.upper(),
                _tracker_device().upper(),
            )
        else:
            tensor_parallel.get_cuda_rng_tracker().set_states(dict(tracker_states))


def rng_sharded_object(state: dict[str, Any] | None) -> Any:
    """A ``ShardedObject`` holding this rank's generator state (``None`` for loading), one
    per global rank."""
    rank, world_size = global_rank(), global_world_size()
    return ShardedObject(RNG_STATE_KEY, state, (world_size,), (rank,), replica_id=0)
