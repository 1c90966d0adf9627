"""Random-number-generator state of one rank, saved per rank and restored on request.

Each rank stores its own generators (Python ``random``, NumPy's global generator, torch's
CPU generator and, with CUDA, every device generator plus megatron's tensor-parallel RNG
tracker) as a megatron ``ShardedObject`` at its global rank. The content is tensors and
plain Python values only, so it loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["RNG_STATE_KEY", "capture_rng_state", "restore_rng_state", "rng_sharded_object"]

RNG_STATE_KEY = "rng_state"


def _numpy_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {
        "bit_generator": str(name),
        "keys": torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }


def _set_numpy_state(state: dict[str, Any]) -> None:
    keys = state["keys"].numpy().astype(np.uint32)
    np.random.set_state(
        (
            state["bit_generator"],
            keys,
            int(state["pos"]),
            int(state["has_gauss"]),
            float(state["cached_gaussian"]),
        )
    )


def capture_rng_state() -> dict[str, Any]:
    """This process's generator states (see the module docstring for what is included)."""
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "random_rng_state": {
            "version": int(version),
            "state": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
        "np_rng_state": _numpy_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": None,
        "rng_tracker_states": None,
    }
    if torch.cuda.is_available():
        state["cuda_rng_state"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
        from megatron.core import tensor_parallel

        tracker = tensor_parallel.get_cuda_rng_tracker()
        state["rng_tracker_states"] = {
            name: value.cpu() for name, value in tracker.get_states().items()
        }
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set this process's generators to ``state`` (from :func:`capture_rng_state`).

    CUDA generators are restored only when the state has them and CUDA is available.
    """
    saved_random = state["random_rng_state"]
    random.setstate(
        (
            int(saved_random["version"]),
            tuple(int(x) for x in saved_random["state"].tolist()),
            saved_random["gauss_next"],
        )
    )
    _set_numpy_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"].to(torch.uint8).cpu())
    if torch.cuda.is_available() and state.get("cuda_rng_state") is not None:
        torch.cuda.set_rng_state_all(state["cuda_rng_state"])
        if state.get("rng_tracker_states") is not None:
            from megatron.core import tensor_parallel

            tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def rng_sharded_object(rank: int, world_size: int, state: dict[str, Any] | None) -> Any:
    """A ``ShardedObject`` holding rank ``rank``'s generator state (``None`` for loading)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(RNG_STATE_KEY, state, (world_size,), (rank,), replica_id=0)
