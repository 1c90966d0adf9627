"""What bridge-logging needs of the trainer's state (the trainer's classes satisfy these).

bridge-logging never imports bridge-train. The trainer's ``TrainState`` and ``GlobalState``
(or any objects, such as dataclasses, with these attributes) are passed in instead. The
members are read-only properties, so a plain dataclass attribute of a compatible type
satisfies them under mypy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from core_utils import Timers

if TYPE_CHECKING:
    from bridge.logging.metric_writers import MetricWriters

__all__ = ["LoggingState", "TrainProgress"]


class TrainProgress(Protocol):
    """Progress counters of a run (bridge-train's ``TrainState`` offers them)."""

    @property
    def step(self) -> int:
        """Iterations completed so far (over every run that resumed this one)."""
        ...

    @property
    def consumed_train_samples(self) -> int:
        """Training samples consumed so far, over all data-parallel ranks."""
        ...

    @property
    def skipped_train_samples(self) -> int:
        """Samples of iterations whose update was skipped."""
        ...

    @property
    def consumed_valid_samples(self) -> int:
        """Validation samples consumed so far."""
        ...

    @property
    def floating_point_operations_so_far(self) -> float:
        """Model FLOPs executed so far; the trainer adds each step's count with its own formula."""
        ...


class LoggingState(Protocol):
    """What :func:`bridge.logging.training_log` needs of the trainer's state: counters,
    timers, writers and the start time (the configuration comes separately, see
    :class:`bridge.logging.TrainingLogSettings`)."""

    @property
    def train_state(self) -> TrainProgress:
        """Progress counters."""
        ...

    @property
    def timers(self) -> Timers:
        """The run's timers; ``"interval-time"`` (log level 0) must run during training."""
        ...

    @property
    def metric_writers(self) -> MetricWriters:
        """The writers built by :func:`bridge.logging.build_metric_writers` on every rank."""
        ...

    @property
    def start_time(self) -> float:
        """``time.time()`` when this job started."""
        ...
