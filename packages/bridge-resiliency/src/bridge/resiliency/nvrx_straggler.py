"""nvidia-resiliency-ext straggler detection: GPU performance scores and a stop decision.

NVRx's ``straggler.Detector`` profiles the CUDA kernels of a wrapped callable (the train
step) with CUPTI and, every ``report_time_interval`` seconds, scores each GPU:

* *relative* score: this rank's speed / the fastest rank's (needs all ranks);
* *individual* score: this rank's speed now / its own best so far.

A rank whose score falls under ``gpu_relative_perf_threshold`` /
``gpu_individual_perf_threshold`` is a straggler. :class:`NVRxStragglerMonitor` wires this
to ``NVRxStragglerDetectionConfig``: it prints the best and worst
``num_gpu_perf_scores_to_print`` scores (with 0: the stragglers and the best rank, only
when there are stragglers), logs min/median/max, and with
``stop_if_detected`` asks the loop to end cleanly with a checkpoint (it is a
:class:`~bridge.resiliency.StopRequester` for :class:`~bridge.resiliency.ExitConditions`).

The detector needs CUDA and CUPTI (``libcupti.so.12``); without them :meth:`initialize`
fails with a message saying so. The score evaluation (:func:`assess_straggler_report`,
:meth:`NVRxStragglerMonitor.evaluate`) is plain Python and works on any report with the
fields of ``nvidia_resiliency_ext.straggler.Report``.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from bridge.config import NVRxStragglerDetectionConfig
from bridge.resiliency.errors import ResiliencyError, missing_nvrx
from core_utils.distributed import global_rank

__all__ = [
    "NVRxStragglerMonitor",
    "PerfReport",
    "StragglerAssessment",
    "assess_straggler_report",
    "format_perf_scores",
]


class PerfReport(Protocol):
    """The fields of ``nvidia_resiliency_ext.straggler.Report`` that are evaluated."""

    @property
    def gpu_relative_perf_scores(self) -> Mapping[int, float]:
        """Rank -> relative GPU performance score (0..1)."""
        ...

    @property
    def gpu_individual_perf_scores(self) -> Mapping[int, float]:
        """Rank -> individual GPU performance score (0..1)."""
        ...

    @property
    def rank_to_node(self) -> Mapping[int, str]:
        """Rank -> node name."""
        ...


@dataclass(frozen=True)
class StragglerAssessment:
    """The verdict on one straggler report.

    Attributes:
        relative_stragglers: Ranks whose relative score is below the threshold (sorted).
        individual_stragglers: Ranks whose individual score is below the threshold.
        lines: The text printed for this report (scores and warnings).
        summary: ``<kind>/min``, ``<kind>/median``, ``<kind>/max`` of each computed score.
    """

    relative_stragglers: tuple[int, ...]
    individual_stragglers: tuple[int, ...]
    lines: tuple[str, ...]
    summary: Mapping[str, float]

    @property
    def stragglers_found(self) -> bool:
        """Whether any rank is a straggler by either score."""
        return bool(self.relative_stragglers or self.individual_stragglers)

    @property
    def straggler_ranks(self) -> tuple[int, ...]:
        """All straggler ranks, by either score, sorted."""
        return tuple(sorted(set(self.relative_stragglers) | set(self.individual_stragglers)))


def format_perf_scores(
    scores: Mapping[int, float], rank_to_node: Mapping[int, str], count: int
) -> list[str]:
    """Lines listing the worst and best ``count`` ranks (all ranks if there are few).

    Args:
        scores: Rank -> score.
        rank_to_node: Rank -> node name (missing ranks show ``?``).
        count: How many worst and how many best ranks to list.

    Returns:
        One line per listed rank, worst first, with headers when the list is cut.
    """
    ordered = sorted(scores.items(), key=lambda item: (item[1], item[0]))
    if len(ordered) <= 2 * count:
        return [_score_line(r, s, rank_to_node) for r, s in ordered]
    lines = [f" worst {count}/{len(ordered)} ranks:"]
    lines += [_score_line(r, s, rank_to_node) for r, s in ordered[:count]]
    lines.append(f" best {count}/{len(ordered)} ranks:")
    lines += [_score_line(r, s, rank_to_node) for r, s in reversed(ordered[-count:])]
    return lines


def _straggler_score_lines(
    scores: Mapping[int, float], rank_to_node: Mapping[int, str], stragglers: tuple[int, ...]
) -> list[str]:
    """Lines listing the straggler ranks (worst first, the worst rank of all among them)
    and the best rank."""
    ordered = sorted(scores.items(), key=lambda item: (item[1], item[0]))
    flagged = set(stragglers)
    best_rank, best_score = ordered[-1]
    lines = [f" stragglers {len(flagged)}/{len(ordered)} ranks, worst first:"]
    lines += [_score_line(r, s, rank_to_node) for r, s in ordered if r in flagged]
    if best_rank not in flagged:
        lines.append(" best rank:")
        lines.append(_score_line(best_rank, best_score, rank_to_node))
    return lines


def _score_line(rank: int, score: float, rank_to_node: Mapping[int, str]) -> str:
    return f"  rank={rank} node={rank_to_node.get(rank, '?')} score={score:.3f}"


def _summary(prefix: str, scores: Mapping[int, float]) -> dict[str, float]:
    values = list(scores.values())
    if not values:
        nan = float("nan")
        return {f"{prefix}/min": nan, f"{prefix}/median": nan, f"{prefix}/max": nan}
    return {
        f"{prefix}/min": min(values),
        f"{prefix}/median": float(statistics.median(values)),
        f"{prefix}/max": max(values),
    }


def assess_straggler_report(
    report: PerfReport, config: NVRxStragglerDetectionConfig
) -> StragglerAssessment:
    """Find the stragglers in ``report`` and build the text to print, as configured.

    Only the scores the config computes (``calc_relative_gpu_perf``,
    ``calc_individual_gpu_perf``) are judged and printed. With
    ``num_gpu_perf_scores_to_print = N > 0`` the worst and best ``N`` ranks of each score
    are listed after every report. With 0, scores are listed only for a score that found
    stragglers, and then only the stragglers (the worst rank is always one of them) and
    the best rank, however large the job.

    Args:
        report: A straggler report (on rank 0 it holds every rank's scores).
        config: The ``nvrx_straggler`` section.

    Returns:
        The assessment.
    """
    kinds: list[tuple[str, Mapping[int, float], float]] = []
    if config.calc_relative_gpu_perf:
        kinds.append(
            ("relative", report.gpu_relative_perf_scores, config.gpu_relative_perf_threshold)
        )
    if config.calc_individual_gpu_perf:
        kinds.append(
            (
                "individual",
                report.gpu_individual_perf_scores,
                config.gpu_individual_perf_threshold,
            )
        )
    found: dict[str, tuple[int, ...]] = {"relative": (), "individual": ()}
    summary: dict[str, float] = {}
    for kind, scores, threshold in kinds:
        found[kind] = tuple(sorted(r for r, s in scores.items() if s < threshold))
        summary.update(_summary(f"gpu_{kind}_perf", scores))
    lines: list[str] = []
    for kind, _, threshold in kinds:
        if found[kind]:
            lines.append(
                f"STRAGGLER DETECTION WARNING: ranks {list(found[kind])} have a {kind} GPU "
                f"performance score below {threshold}"
            )
    show = config.num_gpu_perf_scores_to_print
    for kind, scores, _ in kinds:
        if show > 0:
            lines.append(f"GPU {kind} performance scores:")
            lines += format_perf_scores(scores, report.rank_to_node, show)
        elif found[kind]:
            lines.append(f"GPU {kind} performance scores:")
            lines += _straggler_score_lines(scores, report.rank_to_node, found[kind])
    return StragglerAssessment(
        relative_stragglers=found["relative"],
        individual_stragglers=found["individual"],
        lines=tuple(lines),
        summary=summary,
    )


def _import_straggler() -> Any:
    try:
        import nvidia_resiliency_ext.straggler as straggler
    except ImportError as exc:
        raise missing_nvrx("nvrx_straggler.enabled", exc) from exc
    return straggler


class NVRxStragglerMonitor:
    """nvidia-resiliency-ext straggler detection for one rank.

    Loop integration (all methods are no-ops when ``enabled`` is off)::

        monitor = NVRxStragglerMonitor.from_config(cfg.nvrx_straggler)
        monitor.initialize()                    # at setup; fails clearly without CUDA
        train_step = monitor.wrap(train_step)   # profile the step's kernels
        exits = ExitConditions.from_config(..., stop_requesters=[monitor])
        while training:
            train_step(...)
            monitor.poll()                      # every step, every rank
            decision = exits.check(iteration)   # stops when stragglers were found
        monitor.shutdown()

    Args:
        config: The ``nvrx_straggler`` section (``None``: off).
        rank: Global rank (default: torch.distributed's, else ``$RANK``).
    """

    def __init__(
        self, config: NVRxStragglerDetectionConfig | None, *, rank: int | None = None
    ) -> None:
        self.config = config if config is not None else NVRxStragglerDetectionConfig()
        self.rank = global_rank(launcher_fallback=True) if rank is None else rank
        self.logger = logging.getLogger(self.config.logger_name)
        self.last_assessment: StragglerAssessment | None = None
        self._stop = False
        self._detector: Any = None
        self._wrapped: dict[int, Callable[..., Any]] = {}

    @classmethod
    def from_config(
        cls, config: NVRxStragglerDetectionConfig | None, *, rank: int | None = None
    ) -> NVRxStragglerMonitor:
        """Build the monitor of the ``nvrx_straggler`` section (inert when off)."""
        return cls(config, rank=rank)

    @property
    def enabled(self) -> bool:
        """Whether NVRx straggler detection is switched on."""
        return self.config.enabled

    @property
    def scores_to_compute(self) -> list[str]:
        """The NVRx score names requested by the config."""
        names = []
        if self.config.calc_relative_gpu_perf:
            names.append("relative_perf_scores")
        if self.config.calc_individual_gpu_perf:
            names.append("individual_perf_scores")
        return names

    def initialize(self) -> None:
        """Start NVRx's detector (nothing when off).

        Raises:
            MissingExtraError: nvidia-resiliency-ext is not installed.
            ResiliencyError: No CUDA device, or CUPTI cannot be loaded.
        """
        if not self.enabled or self._detector is not None:
            return
        straggler = _import_straggler()
        if not torch.cuda.is_available():
            raise ResiliencyError(
                "nvrx_straggler.enabled: nvidia-resiliency-ext's straggler detector times "
                "CUDA kernels with CUPTI and requires CUDA, but no GPU is visible. Switch "
                "nvrx_straggler.enabled off on CPU; straggler.log_straggler "
                "(core_utils.StragglerDetector) works on CPU."
            )
        try:
            straggler.Detector.initialize(
                scores_to_compute=self.scores_to_compute,
                gather_on_rank0=True,
                profiling_interval=self.config.profiling_interval,
                report_time_interval=self.config.report_time_interval,
            )
        except (ImportError, OSError) as exc:
            raise ResiliencyError(
                f"nvrx_straggler.enabled: the straggler detector could not load CUPTI ({exc}); "
                "install the CUDA toolkit's CUPTI (libcupti.so.12) or switch "
                "nvrx_straggler.enabled off"
            ) from exc
        self._detector = straggler.Detector
        self._callable_id = straggler.CallableId

    def wrap(self, step: Callable[..., Any]) -> Callable[..., Any]:
        """Return ``step`` instrumented for kernel profiling (``step`` itself when off).

        Raises:
            ResiliencyError: Detection is on but :meth:`initialize` was not called.
        """
        if not self.enabled:
            return step
        if self._detector is None:
            raise ResiliencyError(
                "NVRxStragglerMonitor.wrap: call initialize() first (nvrx_straggler.enabled)"
            )
        if id(step) in self._wrapped:
            return self._wrapped[id(step)]

        class _Holder:
            # NVRx instruments an attribute of an object in place.
            def __init__(self, fn: Callable[..., Any]) -> None:
                self.step = fn

            def __call__(self, *args: Any, **kwargs: Any) -> Any:
                return self.step(*args, **kwargs)

        holder = _Holder(step)
        self._detector.wrap_callables(callable_ids=[self._callable_id(holder, "step")])
        self._wrapped[id(step)] = holder
        return holder

    def poll(self) -> StragglerAssessment | None:
        """Generate a report when the interval elapsed and evaluate it on rank 0.

        Call on every rank after every step (report generation is a collective inside
        NVRx, synchronised on its interval).

        Returns:
            The assessment on rank 0 when a report was generated, else ``None``.
        """
        if not self.enabled or self._detector is None:
            return None
        report = self._detector.generate_report_if_interval_elapsed()
        if report is None or self.rank != 0:
            return None
        return self.evaluate(report)

    def evaluate(self, report: PerfReport) -> StragglerAssessment:
        """Judge one report: log it, and request a stop if configured and stragglers exist.

        Args:
            report: A report holding every rank's scores (rank 0's with ``gather_on_rank0``).

        Returns:
            The assessment (also kept as :attr:`last_assessment`).
        """
        assessment = assess_straggler_report(report, self.config)
        self.last_assessment = assessment
        for line in assessment.lines:
            if line.startswith("STRAGGLER"):
                self.logger.warning(line)
            else:
                self.logger.info(line)
        if self.config.enable_logging:
            self.logger.info("GPU performance score summary: %s", dict(assessment.summary))
        if assessment.stragglers_found and self.config.stop_if_detected:
            self.logger.error(
                "stragglers %s detected and nvrx_straggler.stop_if_detected is set: asking "
                "training to save a checkpoint and stop",
                list(assessment.straggler_ranks),
            )
            self._stop = True
        return assessment

    def stop_requested(self) -> bool:
        """Whether this rank found stragglers and ``stop_if_detected`` is set.

        Only rank 0 evaluates reports; :class:`~bridge.resiliency.ExitConditions` reduces
        the flag over all ranks, so every rank stops at the same iteration.
        """
        return self._stop

    def shutdown(self) -> None:
        """Stop NVRx's detector and restore wrapped callables (idempotent)."""
        detector, self._detector = self._detector, None
        self._wrapped.clear()
        if detector is not None:
            detector.shutdown()
