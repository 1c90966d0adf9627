"""megatron-core's engine: distributed initialisation, model wrapping, optimizer, schedule."""

from bridge.train.engine.base import ENGINE_NAMES, Engine, build_engine
from bridge.train.engine.megatron import MegatronEngine

__all__ = ["ENGINE_NAMES", "Engine", "MegatronEngine", "build_engine"]
