"""The training loop and learning-rate schedule sections."""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass, field
from typing import Literal

from bridge.config._checks import at_least, at_most_one, within
from bridge.config._codec import normalize_fields
from bridge.config._errors import ConfigError, field_error, section_error
from bridge.config._section import config_section

logger = logging.getLogger(__name__)

_warned_engine = False


def warn_deprecated_engine(value: str) -> None:
    """Log, once per process and on the launcher's rank 0 only, that ``train.engine`` is
    deprecated (``ConfigContainer.validate`` calls it when the field is set).

    A run validates its config more than once (the command, then ``pretrain``), before any
    process group exists, so the rank is the launcher's ``$RANK``. A saved config read back
    (a checkpoint's ``run_config.yaml``) is not validated and does not warn.
    """
    global _warned_engine
    if _warned_engine or os.environ.get("RANK", "0") != "0":
        return
    _warned_engine = True
    logger.warning(
        "train.engine=%r is deprecated and will be removed in the next release: "
        "megatron-core's engine is the only engine (on CPU through core_utils.cuda_emulation); "
        "remove train.engine from the config",
        value,
    )


@config_section
@dataclass(kw_only=True)
class SchedulerConfig:
    """Configuration settings for the learning rate scheduler and weight decay."""

    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = "linear"
    """Shape of the learning-rate decay after warmup. ``"WSD"`` (warmup-stable-decay) needs
    ``lr_wsd_decay_iters`` (or ``lr_wsd_decay_samples``)."""

    lr_wsd_decay_style: Literal["exponential", "linear", "cosine"] = "exponential"
    """Shape of the final annealing phase of a WSD schedule."""

    lr_decay_iters: int | None = None
    """Iterations over which the learning rate decays; ``validate()`` sets it to
    ``train.train_iters`` when unset."""

    lr_wsd_decay_iters: int | None = None
    """Iterations of the annealing phase of a WSD schedule."""

    lr_warmup_fraction: float | None = None
    """Warmup length as a fraction (0 to 1) of the decay length. Exclusive with
    ``lr_warmup_iters`` and ``lr_warmup_samples``: any value, 0.0 included, counts as set,
    so leave those at 0."""

    lr_warmup_iters: int = 0
    """Iterations of linear learning-rate warmup."""

    lr_warmup_init: float = 0.0
    """Learning rate at the start of warmup."""

    override_opt_param_scheduler: bool = False
    """On resume, take the scheduler settings (learning rates, warmup, decay length and
    style) from this config and ignore those saved in the checkpoint. Exclusive with
    ``use_checkpoint_opt_param_scheduler``."""

    use_checkpoint_opt_param_scheduler: bool = False
    """On resume, take the scheduler settings from the checkpoint and ignore this config."""

    start_weight_decay: float | None = None
    """Weight decay at the start of training (defaults to the optimizer's ``weight_decay``)."""

    end_weight_decay: float | None = None
    """Weight decay at the end of training (defaults to the optimizer's ``weight_decay``)."""

    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = "constant"
    """How weight decay moves from ``start_weight_decay`` to ``end_weight_decay``; the
    non-constant styles need both set."""

    lr_decay_samples: int | None = None
    """Sample-based training (``train.train_samples``): samples over which the learning rate
    decays, default ``train.train_samples``. Exclusive with the ``*_iters`` fields."""

    lr_warmup_samples: int = 0
    """Sample-based training: samples of linear learning-rate warmup."""

    lr_wsd_decay_samples: int | None = None
    """Sample-based training: samples of the annealing phase of a WSD schedule."""

    lr_warmup_steps: int | None = field(init=False, default=None)
    """Warmup length in samples, as the megatron scheduler counts it. Computed by
    ``ConfigContainer.validate()``; not settable."""

    lr_decay_steps: int | None = field(init=False, default=None)
    """Decay length in samples. Computed by ``ConfigContainer.validate()``; not settable."""

    wd_incr_steps: int | None = field(init=False, default=None)
    """Length of the weight-decay schedule in samples. Computed by
    ``ConfigContainer.validate()``; not settable."""

    wsd_decay_steps: int | None = field(init=False, default=None)
    """Length of the WSD annealing phase in samples. Computed by
    ``ConfigContainer.validate()``; not settable."""

    def __post_init__(self) -> None:
        """Check the field types and ranges, warmup and decay settings, WSD and weight decay."""
        normalize_fields(self)
        for name in (
            "lr_decay_iters",
            "lr_wsd_decay_iters",
            "lr_decay_samples",
            "lr_wsd_decay_samples",
        ):
            at_least(self, name, 1)
        at_least(self, "lr_warmup_iters", 0, allow_none=False)
        at_least(self, "lr_warmup_samples", 0, allow_none=False)
        at_least(self, "lr_warmup_init", 0.0, allow_none=False)
        within(self, "lr_warmup_fraction", 0.0, 1.0)
        # A fraction counts as set whenever it is not None (0.0 means "no warmup"), as in
        # megatron, which requires lr_warmup_iters == 0 once a fraction is given.
        at_most_one(
            self,
            "lr_warmup_fraction",
            "lr_warmup_iters",
            "lr_warmup_samples",
            unset={
                "lr_warmup_fraction": (None,),
                "lr_warmup_iters": (0,),
                "lr_warmup_samples": (0,),
            },
        )
        iteration_fields = [
            n for n in ("lr_decay_iters", "lr_wsd_decay_iters") if getattr(self, n) is not None
        ] + (["lr_warmup_iters"] if self.lr_warmup_iters else [])
        sample_fields = [
            n for n in ("lr_decay_samples", "lr_wsd_decay_samples") if getattr(self, n) is not None
        ] + (["lr_warmup_samples"] if self.lr_warmup_samples else [])
        if iteration_fields and sample_fields:
            raise section_error(
                self,
                f"iteration-based ({', '.join(iteration_fields)}) and sample-based "
                f"({', '.join(sample_fields)}) settings cannot be mixed; use *_iters with "
                "train.train_iters or *_samples with train.train_samples",
            )
        if (
            self.lr_decay_style == "WSD"
            and self.lr_wsd_decay_iters is None
            and self.lr_wsd_decay_samples is None
        ):
            raise field_error(
                self,
                "lr_wsd_decay_iters",
                None,
                "lr_decay_style 'WSD' needs the length of its annealing phase: set "
                "lr_wsd_decay_iters (or lr_wsd_decay_samples)",
            )
        at_most_one(
            self,
            "override_opt_param_scheduler",
            "use_checkpoint_opt_param_scheduler",
            unset=(False,),
        )
        self._check_weight_decay()

    def _check_weight_decay(self) -> None:
        start, end = self.start_weight_decay, self.end_weight_decay
        at_least(self, "start_weight_decay", 0.0)
        at_least(self, "end_weight_decay", 0.0)
        if (start is None) != (end is None):
            missing = "end_weight_decay" if end is None else "start_weight_decay"
            raise field_error(
                self, missing, None, "set start_weight_decay and end_weight_decay together"
            )
        if self.weight_decay_incr_style != "constant":
            if start is None:
                raise field_error(
                    self,
                    "start_weight_decay",
                    None,
                    f"weight_decay_incr_style {self.weight_decay_incr_style!r} needs "
                    "start_weight_decay and end_weight_decay",
                )
            assert end is not None
            if end < start:
                raise section_error(
                    self,
                    f"end_weight_decay ({end}) is below start_weight_decay ({start}); an increment "
                    "schedule needs end >= start",
                )
        elif start is not None and start != end:
            raise section_error(
                self,
                f"start_weight_decay ({start}) and end_weight_decay ({end}) differ but "
                "weight_decay_incr_style is 'constant'; make them equal or choose 'linear' or 'cosine'",
            )


@config_section
@dataclass(kw_only=True)
class TrainingConfig:
    """Configuration settings related to the training loop and validation."""

    micro_batch_size: int | None = None
    """Samples per model replica per forward/backward pass. The global batch is this times
    the data-parallel size times the number of microbatches. Required by ``validate()``."""

    global_batch_size: int | None = None
    """Samples per optimizer step; a multiple of ``micro_batch_size`` times the data-parallel
    size. Unset: ``micro_batch_size`` times the data-parallel size (one microbatch),
    filled in by ``validate()``."""

    rampup_batch_size: list[int] | None = None
    """Batch-size ramp-up as ``[start, increment, ramp-up samples]``: e.g. ``[16, 8, 300000]``
    with a global batch of 1024 starts at 16 and grows by 8 over ``(1024 - 16) / 8 = 126``
    steps spread over 300000 samples. Needs ``train_samples``."""

    decrease_batch_size_if_needed: bool = False
    """When ``micro_batch_size`` times the data-parallel size does not divide
    ``global_batch_size`` (for example after losing nodes), train with the largest global
    batch that it divides instead of failing."""

    empty_unused_memory_level: Literal[0, 1, 2] = 0
    """Release cached CUDA memory every iteration to limit fragmentation: 0 off,
    1 moderate, 2 aggressive."""

    check_weight_hash_across_dp_replicas_interval: int | None = None
    """Every this many iterations, check that the weights are identical across data-parallel
    replicas (unset: never)."""

    train_sync_interval: int | None = None
    """Every this many iterations, synchronise the CPU with the GPU so the host does not run
    too far ahead (unset: never)."""

    train_iters: int | None = None
    """Total iterations to train, over all runs that resume this one. Exclusive with
    ``train_samples``; one of them is required unless ``skip_train``."""

    train_samples: int | None = None
    """Total samples to train, for sample-based schedules (batch-size ramp-up, ``*_samples``
    scheduler settings). Exclusive with ``train_iters``."""

    exit_interval: int | None = None
    """Stop (after saving) once the iteration number is a multiple of this."""

    exit_duration_in_mins: int | None = None
    """Stop (after saving) once the run has lasted this many minutes."""

    exit_signal_handler: bool = False
    """On ``exit_signal``, save a checkpoint and shut down cleanly."""

    # Differs from the reference page, which renders this non-literal default as None: the
    # field is an int (None is not one) and the handler is documented to react to SIGTERM.
    # Listed under "Differences from the reference" in docs/configuration.md.
    exit_signal: int = signal.SIGTERM
    """Signal that triggers the save-and-exit handler (stored as a ``signal.Signals``)."""

    exit_signal_handler_for_dataloader: bool = False
    """Install the signal handler in dataloader worker processes too."""

    manual_gc: bool = False
    """Turn off Python's threshold-based garbage collector and collect at fixed points
    instead, so collections happen at the same time on every rank. By default that is only
    at the start and end of each evaluation."""

    manual_gc_interval: int = 0
    """With ``manual_gc``, also collect every this many training iterations (0: never)."""

    manual_gc_eval: bool = True
    """With ``manual_gc``, collect at the start and end of each evaluation."""

    eval_iters: int = 100
    """Iterations (batches) per evaluation on the validation and test sets."""

    eval_interval: int | None = 1000
    """Evaluate on the validation set every this many iterations (unset: never)."""

    skip_train: bool = False
    """Skip training: only evaluate (if configured) and exit."""

    engine: Literal["portable", "megatron"] | None = None
    """Deprecated; removed in the next release. megatron-core's engine (its DDP, optimizers
    incl. the distributed optimizer, and pipeline schedules) is the only engine, on GPUs and
    on CPU (through core-utils' CUDA emulation). A run whose config sets this field (either
    value) logs one warning; ``"portable"`` is still accepted and trains on megatron-core's
    engine. Leave it unset."""

    def __post_init__(self) -> None:
        """Check the field types, sizes, intervals, exit and evaluation settings."""
        normalize_fields(self)
        for name in (
            "micro_batch_size",
            "global_batch_size",
            "train_samples",
            "exit_interval",
            "exit_duration_in_mins",
            "check_weight_hash_across_dp_replicas_interval",
            "train_sync_interval",
            "eval_interval",
        ):
            at_least(self, name, 1)
        at_least(self, "train_iters", 0)
        at_least(self, "eval_iters", 0, allow_none=False)
        at_least(self, "manual_gc_interval", 0, allow_none=False)
        at_most_one(self, "train_iters", "train_samples")
        rampup = self.rampup_batch_size
        if rampup is not None and (len(rampup) != 3 or any(v < 1 for v in rampup)):
            raise field_error(
                self,
                "rampup_batch_size",
                self.rampup_batch_size,
                "expected three positive integers [start batch size, increment, ramp-up samples]",
            )
        try:
            self.exit_signal = signal.Signals(self.exit_signal)
        except ValueError:
            raise field_error(
                self,
                "exit_signal",
                self.exit_signal,
                "expected a signal number such as 15 (SIGTERM) or 10 (SIGUSR1)",
            ) from None


def rampup_increments(train: TrainingConfig) -> int:
    """How many increments ``train.rampup_batch_size`` takes to reach the global batch.

    The ramp-up's rule against ``train.global_batch_size``, said once:
    ``ConfigContainer.validate()`` applies it, and bridge-train's step schedule takes its
    steps from it (the ramp-up's own values are checked when the section is built).

    Args:
        train: A training section with ``rampup_batch_size`` and ``global_batch_size`` set.

    Returns:
        ``(global_batch_size - start) // increment``.

    Raises:
        ConfigError: The start exceeds ``global_batch_size``, or the difference is not a
            whole number of increments.
    """
    assert train.rampup_batch_size is not None and train.global_batch_size is not None
    start, increment, _ = train.rampup_batch_size
    gbs = train.global_batch_size
    if start > gbs:
        raise ConfigError(
            "train.rampup_batch_size",
            f"the start batch size {start} exceeds global_batch_size {gbs}",
        )
    if (gbs - start) % increment:
        raise ConfigError(
            "train.rampup_batch_size",
            f"global_batch_size {gbs} minus the start batch size {start} must be a multiple "
            f"of the increment {increment}",
        )
    return (gbs - start) // increment


def scheduler_steps(
    scheduler: SchedulerConfig, train: TrainingConfig | None
) -> dict[str, int | None] | None:
    """Warm-up, decay, weight-decay and WSD lengths in samples, as megatron-core counts them.

    ``ConfigContainer.validate()`` fills the scheduler's ``*_steps`` fields with these values;
    bridge-train calls it for a section that was never validated (the MIMO recipe's).

    Args:
        scheduler: The scheduler section (``*_iters`` or ``*_samples`` lengths).
        train: The training section: ``train_samples`` selects sample-based lengths, else
            ``train_iters`` x ``global_batch_size``.

    Returns:
        ``{"lr_warmup_steps", "lr_decay_steps", "wd_incr_steps", "wsd_decay_steps"}``, or
        ``None`` when neither section gives the decay a length (``train.skip_train``).

    Raises:
        ConfigError: Iterations without ``train.global_batch_size``, a decay of 0, a warm-up
            not shorter than the decay, or a WSD phase longer than the decay.
    """
    train_samples = getattr(train, "train_samples", None)
    train_iters = getattr(train, "train_iters", None)
    gbs = getattr(train, "global_batch_size", None)

    def samples(iters: int | None) -> int | None:
        if iters is None:
            return None
        if gbs is None:
            raise ConfigError(
                "train.global_batch_size", "is needed to turn scheduler iterations into samples"
            )
        return iters * gbs

    def first_set(value: int | None, default: int | None) -> int | None:
        return default if value is None else value

    if train_samples is not None:
        decay = first_set(scheduler.lr_decay_samples, train_samples)
        wd_incr, wsd = train_samples, scheduler.lr_wsd_decay_samples
        warmup, unit, decay_field = scheduler.lr_warmup_samples, "samples", "lr_decay_samples"
    else:
        decay = samples(first_set(scheduler.lr_decay_iters, train_iters))
        wd_incr, wsd = samples(train_iters), samples(scheduler.lr_wsd_decay_iters)
        warmup = samples(scheduler.lr_warmup_iters) or 0
        unit, decay_field = "iterations", "lr_decay_iters"
    if decay is None:
        return None
    if scheduler.lr_warmup_fraction is not None:
        warmup = int(scheduler.lr_warmup_fraction * decay)
    if decay <= 0:
        raise ConfigError(
            f"scheduler.{decay_field}",
            f"the learning rate would decay over 0 {unit}; set train.train_iters/train_samples "
            f"or scheduler.{decay_field} to a positive value",
        )
    if warmup >= decay:
        raise ConfigError(
            "scheduler",
            f"warmup ({warmup} samples) must be shorter than the decay "
            f"({decay} samples); shorten lr_warmup_* or lengthen {decay_field}",
        )
    if wsd is not None and wsd > decay:
        raise ConfigError(
            "scheduler",
            f"the WSD annealing phase ({wsd} samples) is longer than "
            f"the decay ({decay} samples); shorten lr_wsd_decay_* or lengthen {decay_field}",
        )
    return {
        "lr_warmup_steps": warmup,
        "lr_decay_steps": decay,
        "wd_incr_steps": decay if wd_incr is None else wd_incr,
        "wsd_decay_steps": wsd,
    }
