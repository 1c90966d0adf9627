"""The components of the training loop (:class:`core_utils.Callback` subclasses).

Each owns one concern and its state; :func:`standard_components` lists the ones a run's
config switches on, in order. Fault-tolerance heartbeats and straggler timing live in
:mod:`bridge.resiliency.loop_components` so loops outside bridge-train can use them.
"""

from bridge.train.loop.components.checkpointer import (
    Checkpointer,
    FinalizeFunction,
    SaveFunction,
)
from bridge.train.loop.components.evaluation import EvaluateFunction, Evaluator
from bridge.train.loop.components.maintenance import (
    DeviceSync,
    GarbageCollection,
    WeightHashCheck,
    WeightHashMismatchError,
)
from bridge.train.loop.components.metrics import MetricsProcessor
from bridge.train.loop.components.profiler import Profiler
from bridge.train.loop.components.standard import (
    close_components,
    loop_callback_list,
    standard_components,
)

__all__ = [
    "Checkpointer",
    "DeviceSync",
    "EvaluateFunction",
    "Evaluator",
    "FinalizeFunction",
    "GarbageCollection",
    "MetricsProcessor",
    "Profiler",
    "SaveFunction",
    "WeightHashCheck",
    "WeightHashMismatchError",
    "close_components",
    "loop_callback_list",
    "standard_components",
]
