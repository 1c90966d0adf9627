"""Execution engines behind one seam: portable (CPU/GPU) and megatron (CUDA, and CPU under emulation)."""

from bridge.train.engines.base import ENGINE_NAMES, Engine, build_engine
from bridge.train.engines.megatron import MegatronEngine
from bridge.train.engines.portable import PortableEngine
from bridge.train.engines.portable_ddp import PortableDistributedDataParallel
from bridge.train.engines.portable_optimizer import (
    DynamicLossScaler,
    PortableOptimizer,
    build_portable_optimizer,
)
from bridge.train.engines.portable_schedule import forward_backward_no_pipelining

__all__ = [
    "ENGINE_NAMES",
    "DynamicLossScaler",
    "Engine",
    "MegatronEngine",
    "PortableDistributedDataParallel",
    "PortableEngine",
    "PortableOptimizer",
    "build_engine",
    "build_portable_optimizer",
    "forward_backward_no_pipelining",
]
