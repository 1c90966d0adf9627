"""Throughput, runtime and memory reports, checked against hand-computed numbers."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from bridge.config import ConfigError, LoggerConfig, ProfilingConfig, TrainingConfig
from bridge.logging import (
    MEMORY_KEYS,
    BackendSettings,
    MetricWriters,
    ReportSettings,
    reduce_max_memory_across_pp_group,
    report_memory,
    report_runtime,
    report_throughput,
    start_memory_history_recording,
)
from bridge.logging.memory import format_memory_stats, maybe_dump_memory_snapshot
from bridge.logging.settings import backend_settings_for, report_settings_for

TRAIN = TrainingConfig(micro_batch_size=2, global_batch_size=8, train_iters=100)


def test_throughput_is_window_batches_over_window_plus_one_timestamps() -> None:
    # Timestamps at the end of iterations 0 (start), 1..5: 0, 1, 3, 6, 10, 15 seconds.
    history = [0.0, 1.0, 3.0, 6.0, 10.0, 15.0]
    report = report_throughput(
        TRAIN, iteration=5, seq_length=16, history_wct=history, window_size=3
    )
    # Iterations 3, 4, 5 ran between t=3 (end of 2) and t=15: 3 batches in 12 s.
    assert report["throughput/batches_per_sec"] == pytest.approx(3 / 12)
    assert report["throughput/samples_per_sec"] == pytest.approx(3 / 12 * 8)
    assert report["throughput/tokens_per_sec"] == pytest.approx(3 / 12 * 8 * 16)
    # One process: per-device values equal the totals.
    assert report["throughput/device/tokens_per_sec"] == pytest.approx(3 / 12 * 8 * 16)
    assert set(report) == {
        "throughput/batches_per_sec",
        "throughput/samples_per_sec",
        "throughput/tokens_per_sec",
        "throughput/device/batches_per_sec",
        "throughput/device/samples_per_sec",
        "throughput/device/tokens_per_sec",
    }
    # A window of 5 iterations needs 6 timestamps: all of them, 5 batches in 15 s.
    whole = report_throughput(TRAIN, iteration=5, seq_length=16, history_wct=history, window_size=5)
    assert whole["throughput/batches_per_sec"] == pytest.approx(5 / 15)


def test_throughput_waits_for_a_full_window_and_skips_bad_windows() -> None:
    assert report_throughput(TRAIN, 2, 16, [0.0, 1.0, 2.0], window_size=3) == {}
    assert report_throughput(TRAIN, 3, 16, [5.0, 5.0, 5.0, 5.0], window_size=3) == {}
    with pytest.raises(ValueError, match="window_size must be a positive int, got 0"):
        report_throughput(TRAIN, 3, 16, [0.0, 1.0], window_size=0)
    with pytest.raises(ValueError, match="global_batch_size must be a positive int, got None"):
        report_throughput(TrainingConfig(micro_batch_size=2), 3, 16, [0.0] * 5, window_size=1)


def test_throughput_uses_the_samples_of_the_window_and_needs_seq_length_for_tokens() -> None:
    history = [0.0, 2.0, 4.0]
    # A ramp-up: the two iterations of the window consumed 6 samples, not 2 x 8.
    ramped = report_throughput(TRAIN, 2, 16, history, 2, samples_in_window=6)
    assert ramped["throughput/batches_per_sec"] == pytest.approx(0.5)
    assert ramped["throughput/samples_per_sec"] == pytest.approx(1.5)
    assert ramped["throughput/tokens_per_sec"] == pytest.approx(1.5 * 16)
    # Without global_batch_size, the samples of the window are enough.
    unset = TrainingConfig(micro_batch_size=2)
    assert report_throughput(unset, 2, 16, history, 2, samples_in_window=6) == ramped
    no_tokens = report_throughput(TRAIN, 2, None, history, 2)
    assert no_tokens == {
        "throughput/batches_per_sec": pytest.approx(0.5),
        "throughput/samples_per_sec": pytest.approx(4.0),
        "throughput/device/batches_per_sec": pytest.approx(0.5),
        "throughput/device/samples_per_sec": pytest.approx(4.0),
    }
    with pytest.raises(ValueError, match="samples_in_window must not be negative, got -1"):
        report_throughput(TRAIN, 2, 16, history, 2, samples_in_window=-1)


class _Progress:
    def __init__(self, step: int, samples: int) -> None:
        self.step = step
        self.consumed_train_samples = samples
        self.skipped_train_samples = 0
        self.consumed_valid_samples = 0
        self.floating_point_operations_so_far = 0.0


def test_runtime_estimate_in_each_unit() -> None:
    progress = _Progress(step=4, samples=32)
    report = report_runtime(progress, start_time=100.0, seq_length=16, train_iters=10, now=120.0)
    # 4 iterations in 20 s -> 5 s each; 6 left -> 30 s.
    assert report == {
        "time/remaining_estimate": 30.0,
        "time/tokens": 512.0,
        "time/samples": 32.0,
        "time/batches": 4.0,
        "time/total": 20.0,
    }
    minutes = report_runtime(progress, 100.0, 16, 10, "minutes", now=120.0)
    assert minutes["time/remaining_estimate"] == pytest.approx(0.5)
    assert minutes["time/total"] == pytest.approx(20 / 60)
    assert report_runtime(progress, 100.0, 16, 10, "hours", now=3700.0)["time/total"] == 1.0
    assert report_runtime(progress, 100.0, 16, 10, "days", now=86500.0)["time/total"] == 1.0
    # Resumed at step 2: only 2 iterations ran in this job's 20 s.
    resumed = report_runtime(progress, 100.0, 16, 10, start_iteration=2, now=120.0)
    assert resumed["time/remaining_estimate"] == 60.0
    assert "time/remaining_estimate" not in report_runtime(
        _Progress(0, 0), 100.0, 16, 10, now=120.0
    )


def test_runtime_without_seq_length_or_train_iters_keeps_the_other_metrics() -> None:
    progress = _Progress(step=4, samples=32)
    report = report_runtime(
        progress, start_time=100.0, seq_length=None, train_iters=None, now=120.0
    )
    assert report == {"time/samples": 32.0, "time/batches": 4.0, "time/total": 20.0}
    with_iters = report_runtime(progress, 100.0, None, 10, now=120.0)
    assert with_iters["time/remaining_estimate"] == 30.0 and "time/tokens" not in with_iters


def test_runtime_rejects_bad_units_and_lengths() -> None:
    with pytest.raises(
        ValueError,
        match=r"time_unit must be one of 'seconds', 'minutes', 'hours', 'days', got 'weeks'",
    ):
        report_runtime(_Progress(1, 1), 0.0, 16, 10, "weeks")
    with pytest.raises(ValueError, match="train_iters must be a positive int, got 0"):
        report_runtime(_Progress(1, 1), 0.0, 16, 0)


def test_memory_stats_are_converted_like_the_reference_table() -> None:
    stats = {
        "allocated_bytes.all.current": 1_234_567_890,
        "allocated_bytes.all.peak": 9_876_543_210_987,
        "reserved_bytes.all.current": 0,
        "num_alloc_retries": 3,
        "unrelated": 1,
    }
    report = format_memory_stats(stats)
    assert report == {
        "current_allocated_mem": 1.2346,
        "peak_allocated_mem": 9876.5,
        "current_reserved_mem": 0.0,
        "alloc_retries": 3,
    }
    assert isinstance(report["alloc_retries"], int)
    assert set(MEMORY_KEYS.values()) == {
        "current_allocated_mem",
        "current_active_mem",
        "current_inactive_mem",
        "current_reserved_mem",
        "peak_allocated_mem",
        "peak_active_mem",
        "peak_inactive_mem",
        "peak_reserved_mem",
        "alloc_retries",
    }
    custom = format_memory_stats(stats, {"num_alloc_retries": "retries"})
    assert custom == {"retries": 3}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_memory_report_is_empty_on_cpu_with_a_notice(caplog: Any) -> None:
    from bridge.logging import _notices

    _notices._notices_given.discard("memory-cpu")
    with caplog.at_level(logging.INFO, logger="bridge.logging"):
        assert report_memory() == {}
        assert report_memory() == {}
    assert caplog.text.count("memory reports need CUDA") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_the_cpu_memory_notice_is_given_by_rank_0_only(
    caplog: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every rank of every run printed it; the ranks all find the same.
    from bridge.logging import _notices

    for rank, expected in (("1", 0), ("0", 1)):
        _notices._notices_given.discard("memory-cpu")
        monkeypatch.setenv("RANK", rank)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="bridge.logging"):
            assert report_memory() == {}
        assert caplog.text.count("memory reports need CUDA") == expected, rank


def test_pp_reduction_is_a_no_op_without_distributed() -> None:
    report = {"peak_allocated_mem": 1.5, "alloc_retries": 2}
    assert reduce_max_memory_across_pp_group(report, pp_group=None) is report
    assert reduce_max_memory_across_pp_group({}, pp_group=object()) == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_memory_history_is_a_clear_no_op_on_cpu(caplog: Any, tmp_path: Any) -> None:
    from bridge.logging import _notices

    _notices._notices_given.discard("memory-history-cpu")
    profiling = ProfilingConfig(
        record_memory_history=True,
        profile_ranks=[0],
        profile_step_start=1,
        profile_step_end=2,
        memory_snapshot_path=str(tmp_path / "snap.pickle"),
    )
    with caplog.at_level(logging.INFO, logger="bridge.logging"):
        start_memory_history_recording(profiling)
        start_memory_history_recording(None)
        start_memory_history_recording(ProfilingConfig())
    assert "record_memory_history needs CUDA" in caplog.text
    assert maybe_dump_memory_snapshot(profiling, 2) is None
    assert list(tmp_path.iterdir()) == []


def test_settings_reject_bad_values_naming_the_field() -> None:
    with pytest.raises(
        ConfigError,
        match=r"BackendSettings.comet_mode: got 'sometimes'; expected one of 'auto', 'online', 'offline'",
    ):
        BackendSettings(comet_mode="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"BackendSettings.mlflow_experiment: got ''"):
        BackendSettings(mlflow_experiment="")
    with pytest.raises(ConfigError, match=r"ReportSettings.throughput_window_size: got 0"):
        ReportSettings(throughput_window_size=0)
    with pytest.raises(
        ConfigError,
        match=r"ReportSettings.runtime_time_unit: got 'weeks'; expected one of seconds, minutes, hours, days",
    ):
        ReportSettings(runtime_time_unit="weeks")
    with pytest.raises(ConfigError, match=r"ReportSettings.memory_keys"):
        ReportSettings(memory_keys={})


def test_logger_config_fields_configure_backends_and_reports_and_set_overrides_win() -> None:
    cfg = LoggerConfig(
        mlflow_experiment="exp",
        mlflow_tracking_uri="file:./mlruns",
        mlflow_tags={"team": "nlp"},
        comet_project="proj",
        comet_mode="offline",
        comet_tags=["a"],
        throughput_window_size=7,
        log_runtime_to_tensorboard=True,
        runtime_time_unit="hours",
        log_l2_norm_grad_to_tensorboard=True,
        memory_keys={"allocated_bytes.all.peak": "peak"},
    )
    backends = backend_settings_for(cfg)
    assert (backends.mlflow_experiment, backends.mlflow_tracking_uri) == ("exp", "file:./mlruns")
    assert (backends.mlflow_tags, backends.comet_tags) == ({"team": "nlp"}, ["a"])
    assert (backends.comet_project, backends.comet_mode) == ("proj", "offline")
    assert report_settings_for(cfg) == ReportSettings(
        throughput_window_size=7,
        log_runtime=True,
        runtime_time_unit="hours",
        log_l2_norm_grad=True,
        memory_keys={"allocated_bytes.all.peak": "peak"},
    )
    # Fields set in an override object win; fields left at their default do not.
    merged = backend_settings_for(cfg, BackendSettings(comet_project="other"))
    assert (merged.comet_project, merged.mlflow_experiment) == ("other", "exp")
    reports = report_settings_for(cfg, ReportSettings(throughput_window_size=3))
    assert (reports.throughput_window_size, reports.log_runtime) == (3, True)
    # MetricWriters built without overrides report what the config says.
    assert MetricWriters().reports_for(cfg) == report_settings_for(cfg)
    with pytest.raises(
        TypeError, match="backend_settings must be a BackendSettings or None, got dict"
    ):
        backend_settings_for(cfg, {"comet_project": "x"})  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match="report_settings must be a ReportSettings or None, got int"
    ):
        report_settings_for(cfg, 3)  # type: ignore[arg-type]
