"""Training state: the counters a run advances and a checkpoint restores
(:class:`TrainState`, a state dict of tensors for ``torch.save``, torch.distributed.checkpoint
or dist_checkpointing), and the reference's :class:`GlobalState` (a
:class:`bridge.logging.LoggingState`, as ``training_log`` takes), which the training loop and
a forward step share (a forward step asks for it by annotating a parameter with it, or
naming the first parameter ``state``; see :func:`bridge.train.needs_global_state_injection`).
:func:`bridge.train.pretrain` fills it and the reference's functions take it, but the loop's
components never see it; each is built from its own config section and the pieces of this
state it uses.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

from bridge.config import ConfigContainer
from bridge.logging import MetricWriters
from bridge.resiliency import (
    ExitConditions,
    ExitSignalHandler,
    FaultTolerance,
    NullFaultTolerance,
    NVRxStragglerMonitor,
    RunResiliency,
    StragglerTiming,
    WatchdogTimeouts,
)
from bridge.train.engine.megatron import build_engine
from core_utils import Timers

if TYPE_CHECKING:
    from bridge.train.engine.megatron import Engine

__all__ = ["ForwardStepCallable", "GlobalState", "TrainState"]

ForwardStepCallable = Callable[..., Any]
"""A forward-step function or callable object: ``(data_iterator, model)`` or
``(state, data_iterator, model)`` returning ``(output, loss_func)`` (see
:mod:`bridge.train.loop.state_injection`)."""

# Per annotated type of a TrainState field: the dtype it is stored with in a state dict, and
# the Python type it is restored as.
_STORED_AS: dict[str, tuple[torch.dtype, type]] = {
    "int": (torch.int64, int),
    "float": (torch.float64, float),
    "bool": (torch.bool, bool),
}


@dataclass
class TrainState:
    """Progress of a training run.

    Attributes:
        step: Number of completed training iterations.
        consumed_train_samples: Training samples consumed so far (over all data-parallel
            ranks); the data sampler resumes from here.
        skipped_train_samples: Samples of iterations whose update was skipped (for example
            non-finite gradients under fp16 loss scaling).
        consumed_valid_samples: Validation samples consumed so far.
        floating_point_operations_so_far: Model FLOPs executed so far (see
            :func:`bridge.train.metrics.flops.num_floating_point_operations`).
        do_train: Whether a training dataset exists.
        do_valid: Whether a validation dataset exists.
        do_test: Whether a test dataset exists.
    """

    step: int = 0
    consumed_train_samples: int = 0
    skipped_train_samples: int = 0
    consumed_valid_samples: int = 0
    floating_point_operations_so_far: float = 0.0
    do_train: bool = False
    do_valid: bool = False
    do_test: bool = False

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Return every field as a 0-d CPU tensor (int64 counters, float64 FLOPs, bool flags).

        Returns:
            A dict keyed by field name.
        """
        return {
            f.name: torch.tensor(getattr(self, f.name), dtype=_STORED_AS[str(f.type)][0])
            for f in fields(self)
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the fields from ``state_dict`` (tensors or plain Python numbers).

        Args:
            state_dict: A dict as returned by :meth:`state_dict`.

        Raises:
            KeyError: A field is missing; the message names it.
        """
        missing = [f.name for f in fields(self) if f.name not in state_dict]
        if missing:
            raise KeyError(
                f"TrainState.load_state_dict: missing {missing}; the state dict has "
                f"{sorted(state_dict)}"
            )
        for f in fields(self):
            value = state_dict[f.name]
            if isinstance(value, torch.Tensor):
                value = value.item()
            setattr(self, f.name, _STORED_AS[str(f.type)][1](value))


@dataclass
class GlobalState:
    """State shared by the training loop and forward-step functions.

    Every field has a working default, so ``GlobalState()`` is usable on its own (for a
    forward step called by hand, or a loop without logging or resiliency features).
    :func:`bridge.train.pretrain` fills the fields from the config.

    Attributes:
        cfg: The run's configuration.
        train_state: Progress counters of the run (saved in checkpoints).
        timers: The run's timers (``logger.timing_log_level`` / ``timing_log_option``).
        start_time: Wall-clock time (``time.time()``) at which the job started.
        metric_writers: Metric backends (TensorBoard, W&B, ...); empty on every rank but the
            last, and empty when nothing is configured.
        fault_tolerance: Fault-tolerance hooks (a no-op object when nothing is on).
        straggler_timing: Per-rank step timing for straggler reports (inert when off).
        nvrx_straggler: nvidia-resiliency-ext straggler monitor, when configured.
        exit_conditions: Early-exit conditions (signal, duration, interval), when built by
            the trainer; it owns the exit-signal handler.
        job_start_flops: ``train_state.floating_point_operations_so_far`` when this job
            started training (after a checkpoint was loaded): the job's own FLOPs are the
            counter minus this.
        loaded_iteration: Iteration this job resumed from (0 for a fresh run).
        last_saved_iteration: Iteration of the last persistent checkpoint this job's loop
            saved (``None``: none; a non-persistent checkpoint does not count); set when
            the loop of :func:`bridge.train.pretrain` / :func:`bridge.train.train` ends and
            by :func:`bridge.train.save_checkpoint_and_time`.
        engine: The engine the model was built with (:func:`bridge.train.pretrain` sets it).
            The loop takes its forward-backward schedule from it; ``None`` means megatron-core's
            engine (built on first use).
        last_evaluated_iteration: Iteration of the last validation run of this job's loop
            (``None``: none), set when the loop ends as ``last_saved_iteration`` is.
    """

    cfg: ConfigContainer = field(default_factory=ConfigContainer)
    train_state: TrainState = field(default_factory=TrainState)
    timers: Timers = field(default_factory=lambda: Timers(0, "minmax"))
    start_time: float = field(default_factory=time.time)
    metric_writers: MetricWriters = field(default_factory=MetricWriters)
    fault_tolerance: FaultTolerance = field(default_factory=NullFaultTolerance)
    straggler_timing: StragglerTiming = field(default_factory=StragglerTiming)
    nvrx_straggler: NVRxStragglerMonitor | None = None
    exit_conditions: ExitConditions | None = None
    job_start_flops: float = 0.0
    loaded_iteration: int = 0
    last_saved_iteration: int | None = None
    last_evaluated_iteration: int | None = None
    engine: Engine | None = None

    @property
    def forward_backward_func(self) -> Callable[..., list[Any]]:
        """The engine's forward-backward schedule (megatron's ``forward_backward_func``
        signature). Without an engine set, megatron-core's engine is built: its schedule for
        the current pipeline layout (on CPU inside the CUDA emulation, see
        :attr:`bridge.train.engine.MegatronEngine.forward_backward_func`)."""
        if self.engine is None:
            self.engine = build_engine()
        return self.engine.forward_backward_func

    @property
    def resiliency(self) -> RunResiliency:
        """The resiliency objects of the run, as one :class:`bridge.resiliency.RunResiliency`."""
        return RunResiliency(**{f.name: getattr(self, f.name) for f in fields(RunResiliency)})

    def start_resiliency(
        self, hang_timeout: float | WatchdogTimeouts | None = None
    ) -> RunResiliency:
        """Build and hold the run's resiliency objects from the ``ft``, ``straggler``,
        ``nvrx_straggler``, ``train`` and ``checkpoint`` sections, and start the
        fault-tolerance setup section; done before the checkpoint is loaded, so that a
        signal arriving while it loads is not lost.

        Args:
            hang_timeout: Seconds (or per-phase timeouts) of the built-in hang watchdog.

        Returns:
            The objects, as :attr:`resiliency` gives them.
        """
        cfg = self.cfg
        assert cfg.train is not None and cfg.checkpoint is not None
        resiliency = RunResiliency.build(
            ft=cfg.ft,
            straggler=cfg.straggler,
            nvrx_straggler=cfg.nvrx_straggler,
            train=cfg.train,
            checkpoint_dir=cfg.checkpoint.save,
            async_save=cfg.checkpoint.async_save,
            start_time=self.start_time,
            hang_timeout=hang_timeout,
        )
        for f in fields(RunResiliency):  # this state's fields of the same names
            setattr(self, f.name, getattr(resiliency, f.name))
        resiliency.start_setup()
        return resiliency

    @property
    def signal_handler(self) -> ExitSignalHandler | None:
        """The exit-signal handler (``train.exit_signal_handler``), if one is installed."""
        return None if self.exit_conditions is None else self.exit_conditions.signal_handler

    @property
    def job_floating_point_operations(self) -> float:
        """FLOPs this job executed (the counter minus its value when the job started)."""
        return self.train_state.floating_point_operations_so_far - self.job_start_flops
