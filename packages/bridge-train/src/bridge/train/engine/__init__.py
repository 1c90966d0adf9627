"""megatron-core's engine: distributed initialisation, model wrapping, optimizer, schedule.

The names below load on first use, so that ``bridge.train.engine.launch_env`` (which the
command reads before it decides to import torch) can be imported on its own.
"""

from typing import TYPE_CHECKING

from bridge.train._lazy_exports import lazy_exports

if TYPE_CHECKING:  # the exports: the lookup below is derived from this block
    from bridge.train.engine.megatron import (
        Engine as Engine,
        MegatronEngine as MegatronEngine,
        build_engine as build_engine,
    )

__all__ = sorted(lazy_exports(globals()))
