"""Straggler detection: core_utils.StragglerDetector wiring and the NVRx score evaluation."""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from resiliency_drill import TinyRunOptions, TinyRunResult, run_tiny_training

from bridge.config import NVRxStragglerDetectionConfig, StragglerDetectionConfig
from bridge.resiliency import (
    ExitConditions,
    MissingExtraError,
    NVRxStragglerMonitor,
    ResiliencyError,
    StragglerTiming,
    assess_straggler_report,
    format_perf_scores,
)
from core_utils.testing import find_free_port, run_distributed


def test_timing_off_is_inert() -> None:
    for config in (None, StragglerDetectionConfig(log_straggler=False)):
        timing = StragglerTiming.from_config(config, world_size=1, rank=0)
        assert not timing.configured and not timing.collecting
        with timing.step(), timing.data():
            pass
        assert not timing.maybe_report(10, 1e9, 5)
        assert timing.last_report is None and timing.slowest_rank() is None
        timing.close()


@pytest.mark.parametrize(
    ("enable", "disable", "collecting"),
    [(True, False, True), (False, False, False), (True, True, False)],
)
def test_startup_state_follows_the_config(enable: bool, disable: bool, collecting: bool) -> None:
    config = StragglerDetectionConfig(
        log_straggler=True,
        enable_straggler_on_startup=enable,
        disable_straggler_on_startup=disable,
        straggler_minmax_count=2,
        straggler_ctrlr_port=find_free_port(),
    )
    timing = StragglerTiming.from_config(config, world_size=1, rank=0)
    try:
        assert timing.configured and timing.collecting is collecting
        assert timing.detector is not None and timing.detector.mmcnt == 2
        assert timing.detector.control_port == config.straggler_ctrlr_port
        with pytest.raises(ResiliencyError, match="already configured for world 1 rank 0"):
            StragglerTiming.from_config(config, world_size=2, rank=1)
        with pytest.raises(ResiliencyError, match="log_interval must be >= 1"):
            timing.maybe_report(5, 1e9, 0)
    finally:
        timing.close()
    assert not timing.configured


def _straggler_run(rank: int, world: int, save_dir: str, port: int) -> TinyRunResult:
    torch.set_num_threads(1)
    options = TinyRunOptions(
        save_dir=save_dir,
        train_iters=10,
        save_interval=100,
        log_interval=5,
        log_straggler=True,
        straggler_port=port,
        step_sleep=0.005,
        slow_rank=1,
        slow_rank_sleep=0.1,
    )
    return run_tiny_training(options)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_sleeping_rank_is_reported_as_the_slowest(tmp_path: Path) -> None:
    results = run_distributed(
        _straggler_run, 2, str(tmp_path / "ckpt"), find_free_port(), timeout=150
    )
    for result in results:
        # Two report intervals (iterations 5 and 10); every rank holds the report data.
        assert len(result.slowest_ranks) == 2
        assert 1 in result.slowest_ranks, result.slowest_ranks
    assert results[0].slowest_ranks == results[1].slowest_ranks


@dataclasses.dataclass(frozen=True)
class _Report:
    gpu_relative_perf_scores: Mapping[int, float]
    gpu_individual_perf_scores: Mapping[int, float]
    rank_to_node: Mapping[int, str]


def _report(relative: dict[int, float], individual: dict[int, float]) -> _Report:
    nodes = {r: f"node{r // 4}" for r in relative | individual}
    return _Report(relative, individual, nodes)


def test_assessment_finds_stragglers_by_each_score() -> None:
    config = NVRxStragglerDetectionConfig(
        enabled=True, gpu_relative_perf_threshold=0.7, gpu_individual_perf_threshold=0.8
    )
    report = _report({0: 1.0, 1: 0.5, 2: 0.95}, {0: 0.99, 1: 0.9, 2: 0.75})
    assessment = assess_straggler_report(report, config)
    assert assessment.relative_stragglers == (1,)
    assert assessment.individual_stragglers == (2,)
    assert assessment.straggler_ranks == (1, 2) and assessment.stragglers_found
    assert assessment.summary["gpu_relative_perf/min"] == 0.5
    assert assessment.summary["gpu_individual_perf/median"] == 0.9
    assert any("ranks [1] have a relative GPU performance score below 0.7" in line
               for line in assessment.lines)  # fmt: skip
    # Only the scores the config computes are judged.
    only_relative = dataclasses.replace(config, calc_individual_gpu_perf=False)
    assert assess_straggler_report(report, only_relative).individual_stragglers == ()


def test_scores_are_printed_only_as_configured() -> None:
    healthy = _report({0: 1.0, 1: 0.98}, {0: 1.0, 1: 0.97})
    quiet = NVRxStragglerDetectionConfig(enabled=True, num_gpu_perf_scores_to_print=0)
    assert assess_straggler_report(healthy, quiet).lines == ()
    sick = _report({0: 1.0, 1: 0.2}, {0: 1.0, 1: 1.0})
    lines = assess_straggler_report(sick, quiet).lines
    assert any("rank=1 node=node0 score=0.200" in line for line in lines)
    loud = NVRxStragglerDetectionConfig(enabled=True, num_gpu_perf_scores_to_print=1)
    assert len(assess_straggler_report(healthy, loud).lines) == 2 + 2 * 2


def test_with_nothing_to_print_only_stragglers_and_the_best_rank_are_listed() -> None:
    # 8 ranks, two relative stragglers, none by the individual score.
    relative = {r: 1.0 - r / 100 for r in range(8)} | {3: 0.4, 6: 0.3}
    report = _Report(relative, {r: 0.99 for r in range(8)}, {r: f"n{r}" for r in range(8)})
    quiet = NVRxStragglerDetectionConfig(enabled=True, num_gpu_perf_scores_to_print=0)
    assessment = assess_straggler_report(report, quiet)
    assert assessment.relative_stragglers == (3, 6) and assessment.individual_stragglers == ()
    listed = [line for line in assessment.lines if line.startswith("  rank=")]
    assert listed == [
        "  rank=6 node=n6 score=0.300",  # the worst rank, a straggler
        "  rank=3 node=n3 score=0.400",
        "  rank=0 node=n0 score=1.000",  # the best rank
    ]
    assert " stragglers 2/8 ranks, worst first:" in assessment.lines
    assert " best rank:" in assessment.lines
    # The individual score found no straggler: its scores are not printed at all.
    assert "GPU individual performance scores:" not in assessment.lines
    # A configured count still lists the worst and best N of every computed score.
    loud = dataclasses.replace(quiet, num_gpu_perf_scores_to_print=2)
    lines = assess_straggler_report(report, loud).lines
    assert sum(line.startswith("  rank=") for line in lines) == 2 * 2 * 2


def test_best_and_worst_scores_are_listed() -> None:
    scores = {r: 1.0 - r / 10 for r in range(8)}
    lines = format_perf_scores(scores, {}, 2)
    assert lines[0] == " worst 2/8 ranks:"
    assert "rank=7" in lines[1] and "rank=6" in lines[2]
    assert lines[3] == " best 2/8 ranks:"
    assert "rank=0" in lines[4] and "rank=1" in lines[5] and "node=?" in lines[4]
    assert len(format_perf_scores(scores, {}, 4)) == 8  # few ranks: all, worst first


def test_stop_if_detected_ends_the_run_through_exit_conditions(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = NVRxStragglerDetectionConfig(
        enabled=True, stop_if_detected=True, logger_name="test.nvrx_straggler"
    )
    monitor = NVRxStragglerMonitor.from_config(config, rank=0)
    exits = ExitConditions(stop_requesters=[monitor], save_enabled=True)
    with caplog.at_level(logging.INFO, logger="test.nvrx_straggler"):
        monitor.evaluate(_report({0: 1.0, 1: 0.99}, {0: 1.0, 1: 1.0}))
        assert not monitor.stop_requested() and not exits.check(5).should_exit
        monitor.evaluate(_report({0: 1.0, 1: 0.4}, {0: 1.0, 1: 1.0}))
    assert monitor.stop_requested()
    decision = exits.check(6)
    assert decision.should_exit and decision.should_save and decision.reason == "stop_request"
    assert "asking training to save a checkpoint and stop" in caplog.text
    assert "GPU performance score summary" in caplog.text
    # Without stop_if_detected stragglers are only reported.
    report_only = NVRxStragglerMonitor(dataclasses.replace(config, stop_if_detected=False))
    report_only.evaluate(_report({0: 1.0, 1: 0.4}, {0: 1.0, 1: 1.0}))
    assert not report_only.stop_requested()


def test_disabled_monitor_is_inert() -> None:
    monitor = NVRxStragglerMonitor.from_config(None)
    assert not monitor.enabled
    monitor.initialize()

    def step() -> int:
        return 3

    assert monitor.wrap(step) is step
    assert monitor.poll() is None and not monitor.stop_requested()
    monitor.shutdown()


def test_enabled_monitor_without_the_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nvidia_resiliency_ext", None)
    monkeypatch.setitem(sys.modules, "nvidia_resiliency_ext.straggler", None)
    monitor = NVRxStragglerMonitor(NVRxStragglerDetectionConfig(enabled=True))
    with pytest.raises(
        MissingExtraError,
        match=r"nvrx_straggler\.enabled needs nvidia-resiliency-ext.*pip install bridge-resiliency\[nvrx\]",
    ):
        monitor.initialize()
    with pytest.raises(ResiliencyError, match="call initialize"):
        monitor.wrap(lambda: None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only failure")
def test_enabled_monitor_on_cpu_fails_clearly(nvrx: None) -> None:
    monitor = NVRxStragglerMonitor(NVRxStragglerDetectionConfig(enabled=True))
    with pytest.raises(ResiliencyError, match="requires CUDA, but no GPU is visible") as info:
        monitor.initialize()
    assert "straggler.log_straggler" in str(info.value)


def test_real_nvrx_reports_are_evaluated(nvrx: None) -> None:
    from nvidia_resiliency_ext.straggler import Report

    report = Report(
        gpu_relative_perf_scores={0: 1.0, 1: 0.3},
        section_relative_perf_scores={},
        gpu_individual_perf_scores={0: 0.95, 1: 0.9},
        section_individual_perf_scores={},
        rank_to_node={0: "a", 1: "b"},
        local_section_summaries={},
        local_kernel_summaries={},
        generate_report_elapsed_time=0.0,
        gather_on_rank0=True,
        rank=None,
    )
    config = NVRxStragglerDetectionConfig(enabled=True)
    mine = assess_straggler_report(report, config)
    theirs = report.identify_stragglers(
        gpu_rel_threshold=config.gpu_relative_perf_threshold,
        gpu_indiv_threshold=config.gpu_individual_perf_threshold,
    )
    assert set(mine.relative_stragglers) == {s.rank for s in theirs["straggler_gpus_relative"]}
    assert set(mine.individual_stragglers) == {s.rank for s in theirs["straggler_gpus_individual"]}
    assert mine.relative_stragglers == (1,)
