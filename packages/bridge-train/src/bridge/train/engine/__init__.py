"""megatron-core's engine: distributed initialisation, model wrapping, optimizer, schedule."""

from bridge.train.engine.base import Engine, build_engine
from bridge.train.engine.megatron import MegatronEngine

__all__ = ["Engine", "MegatronEngine", "build_engine"]
