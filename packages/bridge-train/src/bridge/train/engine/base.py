"""The engine seam: :func:`build_engine` and the :data:`Engine` type the loop holds.

There is one engine, :class:`~bridge.train.engine.megatron.MegatronEngine`: megatron-core's
DDP, optimizers (including the distributed optimizer) and pipeline schedules, on CUDA and,
under :func:`core_utils.cuda_emulation`, on CPU with gloo. The loop calls only its handful
of members, in a fixed order: ``initialize_distributed`` once per process, ``setup_model``,
``setup_optimizer``, then ``forward_backward_func`` every iteration (and for evaluation with
``forward_only=True``); it never reaches into megatron-core's machinery.

See ``docs/engines.md``.
"""

from __future__ import annotations

from bridge.train.engine.megatron import MegatronEngine

__all__ = ["Engine", "build_engine"]

Engine = MegatronEngine
"""The type of the engine the loop holds (megatron-core's is the only one)."""


def build_engine() -> Engine:
    """Create the engine: megatron-core's (:class:`~bridge.train.engine.megatron.MegatronEngine`).

    Building it changes no process state; without CUDA the engine enters the CUDA emulation
    only in ``initialize_distributed``.
    """
    return MegatronEngine()
