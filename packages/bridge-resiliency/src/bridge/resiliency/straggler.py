"""Per-rank step timing with ``core_utils.StragglerDetector``, configured from the config.

:class:`StragglerTiming` is what a training loop holds: it configures the process-wide
detector from ``StragglerDetectionConfig`` and hands out context managers that time the
step and the data loading; :meth:`StragglerTiming.maybe_report` compares the ranks every
``log_interval`` iterations. With ``log_straggler`` off every method is a no-op and no
collective is made.
"""

from __future__ import annotations

import contextlib
from typing import Any

from bridge.config import StragglerDetectionConfig
from bridge.resiliency.errors import ResiliencyError
from core_utils import StragglerDetector
from core_utils.distributed import global_rank, global_world_size
from core_utils.straggler import StragglerData

__all__ = ["StragglerTiming"]

_NO_TIMING = contextlib.nullcontext()


class StragglerTiming:
    """Straggler detection of one rank: time regions, report every log interval.

    Args:
        detector: The configured ``StragglerDetector``, or ``None`` when switched off.
    """

    def __init__(self, detector: StragglerDetector | None = None) -> None:
        self.detector = detector

    @classmethod
    def from_config(
        cls,
        config: StragglerDetectionConfig | None,
        *,
        world_size: int | None = None,
        rank: int | None = None,
        amp: float = 3.0,
    ) -> StragglerTiming:
        """Configure ``core_utils.StragglerDetector`` from the ``straggler`` section.

        ``world``/``rank`` come from torch.distributed (or the arguments), ``mmcnt`` from
        ``straggler_minmax_count``, ``port`` from ``straggler_ctrlr_port`` (rank 0 listens
        there for on/off toggles), and collection starts on when
        ``enable_straggler_on_startup`` is set and ``disable_straggler_on_startup`` is not.

        Args:
            config: The ``straggler`` section; ``None`` or ``log_straggler=False``: off.
            world_size: World size (default: torch.distributed's, else ``$WORLD_SIZE``).
            rank: Global rank (default: torch.distributed's, else ``$RANK``).
            amp: Throughput divisor passed to the detector (3.0 when only part of the
                step is timed, see ``StragglerDetector.configure``).

        Returns:
            The timing object (inert when off).

        Raises:
            ResiliencyError: The process-wide detector is already configured for a
                different world or rank.
        """
        if config is None or not config.log_straggler:
            return cls(None)
        world_size = global_world_size(launcher_fallback=True) if world_size is None else world_size
        rank = global_rank(launcher_fallback=True) if rank is None else rank
        detector = StragglerDetector()
        if detector.configured and (detector.world_size, detector.my_rank) != (world_size, rank):
            raise ResiliencyError(
                f"straggler.log_straggler: StragglerDetector is already configured for world "
                f"{detector.world_size} rank {detector.my_rank}, not world {world_size} rank "
                f"{rank}; call StragglerTiming.close() (or StragglerDetector().close()) first"
            )
        detector.configure(
            world_size,
            rank,
            mmcnt=config.straggler_minmax_count,
            amp=amp,
            port=config.straggler_ctrlr_port,
            enabled=config.enable_straggler_on_startup and not config.disable_straggler_on_startup,
        )
        return cls(detector)

    @property
    def configured(self) -> bool:
        """Whether straggler detection is configured (``log_straggler``)."""
        return self.detector is not None

    @property
    def collecting(self) -> bool:
        """Whether timings are being collected now (it can be toggled at runtime)."""
        return self.detector is not None and self.detector.enabled

    def step(self) -> contextlib.AbstractContextManager[Any]:
        """Context manager timing the model's forward of a microbatch.

        As in megatron's ``forward_step`` (``stimer``): the backward and its gradient
        all-reduce, where fast ranks wait for slow ones, are left out, so the slow rank is
        the one that stands out (hence ``amp=3.0``: the forward is a third of the FLOPs).
        """
        return _NO_TIMING if self.detector is None else self.detector(bdata=False)

    def data(self) -> contextlib.AbstractContextManager[Any]:
        """Context manager timing data loading (``next(data_iterator)``, megatron's
        ``stimer(bdata=True)`` around ``get_batch``)."""
        return _NO_TIMING if self.detector is None else self.detector(bdata=True)

    def maybe_report(self, iteration: int, total_flops: float, log_interval: int) -> bool:
        """Compare the ranks when ``iteration`` is a multiple of ``log_interval``.

        A collective on those iterations: every rank must call it after every step.

        Args:
            iteration: Iterations completed.
            total_flops: Floating-point operations of the whole job since the last report
                (the throughput estimate needs it > 0).
            log_interval: Iterations between reports (``logger.log_interval``).

        Returns:
            True when rank 0 logged a report at this iteration.

        Raises:
            ResiliencyError: ``log_interval`` is not positive.
        """
        if self.detector is None:
            return False
        if log_interval < 1:
            raise ResiliencyError(
                f"StragglerTiming.maybe_report: log_interval must be >= 1, got {log_interval}"
            )
        if iteration % log_interval != 0:
            return False
        return self.detector.report(total_flops=total_flops, log_interval=log_interval)

    @property
    def last_report(self) -> StragglerData | None:
        """Minima/maxima with their ranks from the last report (every rank has it)."""
        return None if self.detector is None else self.detector.last_report

    def slowest_rank(self) -> int | None:
        """The rank with the longest step time in the last report (``None`` before one)."""
        report = self.last_report
        return None if report is None else report.max_elapsed.rank

    def close(self) -> None:
        """Stop the control server and unconfigure the process-wide detector."""
        if self.detector is not None:
            self.detector.close()
            self.detector = None
