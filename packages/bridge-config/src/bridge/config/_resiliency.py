"""Fault-tolerance and straggler-detection sections."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from bridge.config._checks import at_least, greater_than, within
from bridge.config._codec import normalize_fields
from bridge.config._errors import field_error, section_error
from bridge.config._section import config_section


@config_section
@dataclass(kw_only=True)
class FaultToleranceConfig:
    """Configuration settings related to fault tolerance mechanisms (NVIDIA internal use)."""

    enable_ft_package: bool = False
    """Report progress to nvidia-resiliency-ext's fault-tolerance rank monitor, which
    restarts hung or failed workers. Needs ``checkpoint.save`` to resume from."""

    calc_ft_timeouts: bool = False
    """Let the fault-tolerance package compute its timeouts from observed iteration and
    checkpoint times."""

    simulate_fault: bool = False
    """Inject a fault, for testing fault tolerance only."""

    simulated_fault_type: Literal["rank_hung", "rank_killed", "random"] = "random"
    """Kind of injected fault: a rank stops making progress, a rank is killed, or one of the
    two chosen at random."""

    simulated_fault_rank: int | None = None
    """Rank the fault is injected on (unset: chosen at random)."""

    simulated_fault_base_delay: int = 0
    """Seconds before the fault is injected; a small random delay is added."""

    def __post_init__(self) -> None:
        """Check the field types, the fault rank and the delay."""
        normalize_fields(self)
        at_least(self, "simulated_fault_rank", 0)
        at_least(self, "simulated_fault_base_delay", 0, allow_none=False)


@config_section
@dataclass(kw_only=True)
class StragglerDetectionConfig:
    """Configuration settings for detecting and logging GPU stragglers."""

    log_straggler: bool = False
    """Measure and log per-rank throughput to find stragglers."""

    enable_straggler_on_startup: bool = True
    """Start with the straggler detector running (it can be toggled at runtime through the
    control port)."""

    straggler_ctrlr_port: int = 65535
    """TCP port of the controller that switches the straggler detector on and off at
    runtime (1 to 65535)."""

    straggler_minmax_count: int = 1
    """How many of the fastest and slowest ranks to report."""

    disable_straggler_on_startup: bool = False
    """Start with the straggler detector switched off."""

    def __post_init__(self) -> None:
        """Check the field types, the control port and the report count."""
        normalize_fields(self)
        within(self, "straggler_ctrlr_port", 1, 65535, allow_none=False)
        at_least(self, "straggler_minmax_count", 1, allow_none=False)


@config_section
@dataclass(kw_only=True)
class NVRxStragglerDetectionConfig:
    """Configuration settings for NVIDIA Resiliency Extension straggler detection."""

    enabled: bool = False
    """Run nvidia-resiliency-ext's straggler detector."""

    report_time_interval: float = 300.0
    """Seconds between straggler checks."""

    calc_relative_gpu_perf: bool = True
    """Score each GPU's performance relative to the others."""

    calc_individual_gpu_perf: bool = True
    """Score each GPU's performance against its own history."""

    num_gpu_perf_scores_to_print: int = 5
    """How many best and worst scores to print at each check (0: print only when
    stragglers are found)."""

    gpu_relative_perf_threshold: float = 0.7
    """Relative score below which a GPU counts as a straggler, in (0, 1]."""

    gpu_individual_perf_threshold: float = 0.7
    """Individual score below which a GPU counts as a straggler, in (0, 1]."""

    stop_if_detected: bool = False
    """Stop training when a straggler is found."""

    enable_logging: bool = True
    """Log the GPU performance scores."""

    profiling_interval: int = 1
    """Profiling interval handed to the detector's ``initialize``."""

    logger_name: str = "megatron_hub.NVRxStragglerDetection"
    """Name of the logger that straggler messages go to."""

    def __post_init__(self) -> None:
        """Check the field types, thresholds, intervals and the score settings."""
        normalize_fields(self)
        greater_than(self, "report_time_interval", 0.0, allow_none=False)
        at_least(self, "profiling_interval", 1, allow_none=False)
        at_least(self, "num_gpu_perf_scores_to_print", 0, allow_none=False)
        within(self, "gpu_relative_perf_threshold", 0.0, 1.0, low_open=True, allow_none=False)
        within(self, "gpu_individual_perf_threshold", 0.0, 1.0, low_open=True, allow_none=False)
        if not self.logger_name:
            raise field_error(
                self, "logger_name", self.logger_name, "expected a non-empty logger name"
            )
        if self.enabled and not (self.calc_relative_gpu_perf or self.calc_individual_gpu_perf):
            raise section_error(
                self,
                "enabled straggler detection needs calc_relative_gpu_perf or calc_individual_gpu_perf",
            )
