"""StragglerDetector: timing, cross-rank report naming the slow rank, control port."""

from __future__ import annotations

import logging
import time
import urllib.request
from typing import Any

import pytest

import core_utils
import core_utils.straggler as straggler_module
from core_utils.straggler import StragglerData, StragglerDetector, ValueWithRank
from core_utils.testing import find_free_port, run_distributed


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_value_with_rank() -> None:
    low, high = ValueWithRank(1.5, 2, "ms"), ValueWithRank(3.0, 0, "ms")
    assert low < high and high > low
    assert low() == (1.5, 2, "ms")
    assert str(low) == "1.50ms/2"
    assert (low.value, low.rank, low.unit) == (1.5, 2, "ms")
    data = StragglerData()
    assert data.min_temp is None and data.aflops is None
    assert data.min_elapsed > data.max_elapsed  # sentinels before any report


def test_singleton_and_disabled_by_default(straggler_detector: StragglerDetector) -> None:
    assert StragglerDetector() is straggler_detector is core_utils.__straggler__
    assert not straggler_detector.configured and not straggler_detector.enabled
    with straggler_detector:  # no-op while unconfigured
        pass
    assert straggler_detector.start_gemm_tm == []
    assert straggler_detector.elapsed() == (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    assert straggler_detector.report(1e12, 10) is False


def test_configure_validates_its_arguments(straggler_detector: StragglerDetector) -> None:
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        straggler_detector.configure(2, 2)
    with pytest.raises(ValueError, match="world must be >= 1"):
        straggler_detector.configure(0, 0)
    with pytest.raises(ValueError, match=r"port must be in 0\.\.65535"):
        straggler_detector.configure(1, 0, port=70000)
    with pytest.raises(ValueError, match="amp must be > 0"):
        straggler_detector.configure(1, 0, amp=0.0)
    with pytest.raises(ValueError, match="mmcnt must be >= 1"):
        straggler_detector.configure(1, 0, mmcnt=0)
    assert not straggler_detector.configured


def test_single_process_timing_and_report(
    straggler_detector: StragglerDetector, caplog: pytest.LogCaptureFixture
) -> None:
    stimer = straggler_detector
    stimer.configure(1, 0, port=0, enabled=True)
    assert stimer.configured and stimer.enabled and (stimer.my_rank, stimer.world_size) == (0, 1)
    assert stimer.control_port is not None
    stimer.configure(4, 3)  # ignored: configured once per process
    assert stimer.world_size == 1
    for _ in range(2):
        with stimer(bdata=True):
            time.sleep(0.01)
        with stimer:
            time.sleep(0.02)
    assert len(stimer.start_data_tm) == 2 and len(stimer.start_gemm_tm) == 2
    with caplog.at_level(logging.INFO, logger="core_utils.straggler"):
        assert stimer.report(total_flops=4e12, log_interval=2) is True
    report = stimer.last_report
    assert report is not None
    assert report.max_elapsed.rank == 0 and report.max_elapsed.value >= 20.0  # ms / iteration
    assert report.max_btime.value >= 10.0  # longest single load
    assert report.min_temp is None  # no GPU metrics on CPU
    assert report.aflops is not None and report.aflops[0].value > 0
    assert "MnRtt/Rnk" in caplog.text and "MxEtpt/Rnk" in caplog.text
    assert "MnTmp" not in caplog.text
    assert stimer.start_gemm_tm == []  # reset after the report
    assert stimer.report(total_flops=0.0, log_interval=2) is False  # nothing to report
    with pytest.raises(KeyError), stimer:  # exceptions are logged and not swallowed
        raise KeyError("inside")
    stimer.close()
    assert not stimer.configured and stimer.control_port is None


def test_explicit_start_stop_elapsed_and_reset(straggler_detector: StragglerDetector) -> None:
    stimer = straggler_detector
    stimer.configure(1, 0, port=0, enabled=True)
    # Lower bounds only: time.sleep guarantees at least the requested time.
    stimer.start()
    time.sleep(0.02)
    stimer.stop()
    stimer.start()
    time.sleep(0.01)
    stimer.stop()
    delta, batch_delta, temp, power, util, clock = stimer.elapsed()
    assert delta >= 30.0  # the two regions add up
    assert batch_delta == 0.0  # no data-loading region
    assert (temp, power, util, clock) == (None, None, None, None)  # no GPU metrics on CPU
    # elapsed() resets: nothing collected since.
    assert stimer.start_gemm_tm == [] and stimer.elapsed()[:2] == (0.0, 0.0)

    # A data-loading region nested in a timed one: stop() closes the data region first.
    stimer.start()
    stimer(bdata=True)
    stimer.start()
    time.sleep(0.02)
    stimer.stop()
    assert stimer.stop_data_tm[-1] != 0 and stimer.stop_gemm_tm[-1] == 0
    stimer.stop()
    assert stimer.stop_gemm_tm[-1] != 0
    for _ in range(2):  # batch time is the longest single load, not the sum
        stimer(bdata=True)
        stimer.start()
        stimer.stop()
    delta, batch_delta = stimer.elapsed()[:2]
    assert batch_delta >= 20.0 and delta >= batch_delta

    # reset() drops what was collected; collection continues afterwards.
    stimer.start()
    time.sleep(0.01)
    stimer.stop()
    stimer(bdata=True)
    stimer.start()
    stimer.stop()
    stimer.reset()
    assert stimer.start_gemm_tm == [] and stimer.start_data_tm == []
    assert stimer.elapsed()[:2] == (0.0, 0.0)
    assert stimer.enabled
    stimer.start()
    stimer.stop()
    assert len(stimer.start_gemm_tm) == 1

    # Once closed (disabled), start/stop are no-ops and elapsed() reports zeros.
    stimer.close()
    stimer.start()
    stimer.stop()
    assert stimer.start_gemm_tm == []
    assert stimer.elapsed() == (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


# Per-rank GPU metrics, chosen so the minimum and maximum of each sit on different ranks.
_FAKE_GPU = {
    "temp": (60.0, 80.0, 70.0),  # min rank 0, max rank 1
    "power": (300.0, 250.0, 200.0),  # min rank 2, max rank 0
    "util": (50.0, 99.0, 10.0),  # min rank 2, max rank 1
    "clock": (1400.0, 1300.0, 1500.0),  # min rank 1, max rank 2
}


def _straggler_on_ranks(rank: int, world_size: int, port: int) -> dict[str, Any]:
    # This CPU machine has no GPU for NVML to read: each rank's metrics source reports
    # its own fixed values, so the cross-rank min/max/rank logic of the report is checked.
    gpu = {name: values[rank] for name, values in _FAKE_GPU.items()}
    straggler_module._gpu_metrics = lambda: dict(gpu)
    handler = _ListHandler()
    logging.getLogger("core_utils.straggler").addHandler(handler)
    logging.getLogger("core_utils.straggler").setLevel(logging.INFO)
    stimer = StragglerDetector()
    stimer.configure(world_size, rank, mmcnt=2, port=port, enabled=True)
    slow_rank = 2
    try:
        out: dict[str, Any] = {}
        for _ in range(3):
            with stimer(bdata=True):
                time.sleep(0.005 if rank != 1 else 0.08)  # rank 1 loads data slowly
            with stimer:
                time.sleep(0.25 if rank == slow_rank else 0.01)
        out["reported"] = stimer.report(total_flops=3e12, log_interval=3)
        data = stimer.last_report
        assert data is not None
        out["max_elapsed"] = data.max_elapsed()
        out["min_elapsed"] = data.min_elapsed()
        out["max_btime"] = data.max_btime()
        out["slowest_flops_rank"] = data.aflops[0].rank if data.aflops else None
        out["ranks_seen"] = [row["rank"] for row in stimer.last_report_ranks or []]
        out["gpu_extremes"] = {
            name: (getattr(data, f"min_{name}")(), getattr(data, f"max_{name}")())
            for name in _FAKE_GPU
        }
        out["gpu_rows"] = [
            {name: row[name] for name in _FAKE_GPU} for row in stimer.last_report_ranks or []
        ]
        out["logged"] = list(handler.messages)
        # rank 0 asks its own control port to toggle collection off.
        if rank == 0:
            assert stimer.control_port == port
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as reply:
                out["reply"] = reply.read().decode()
        out["enabled_before_report"] = stimer.enabled
        stimer.report(total_flops=3e12, log_interval=3)  # applies the toggle everywhere
        out["enabled_after_toggle"] = stimer.enabled
        with stimer:
            time.sleep(0.001)
        out["collected_while_off"] = len(stimer.start_gemm_tm)
        out["report_while_off"] = stimer.report(total_flops=3e12, log_interval=3)
        if rank == 0:  # and back on
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30).close()
        stimer.report()
        out["enabled_after_second_toggle"] = stimer.enabled
        return out
    finally:
        stimer.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_report_names_the_slow_rank_and_the_control_port_toggles() -> None:
    port = find_free_port()
    results = run_distributed(_straggler_on_ranks, 3, port, timeout=130)
    for rank, out in enumerate(results):
        # Every rank sees the same structured report.
        value, slow, unit = out["max_elapsed"]
        assert slow == 2 and unit == "ms" and value >= 250.0
        assert out["min_elapsed"][1] != 2 and out["min_elapsed"][0] < value
        assert out["max_btime"][1] == 1 and out["max_btime"][0] >= 80.0
        assert out["slowest_flops_rank"] == 2
        assert out["ranks_seen"] == [0, 1, 2]
        assert out["reported"] is (rank == 0)  # only rank 0 logs
        # The toggle requested on rank 0 took effect at the next report on every rank.
        assert out["enabled_before_report"] is True
        assert out["enabled_after_toggle"] is False
        assert out["collected_while_off"] == 0
        assert out["report_while_off"] is False
        assert out["enabled_after_second_toggle"] is True
    assert "Will turn StragglerDetector OFF" in results[0]["reply"]
    units = {"temp": "C", "power": "W", "util": "%", "clock": "MHz"}
    for out in results:
        for name, values in _FAKE_GPU.items():
            low, high = out["gpu_extremes"][name]
            assert low == (min(values), values.index(min(values)), units[name])
            assert high == (max(values), values.index(max(values)), units[name])
        assert out["gpu_rows"] == [
            {name: values[r] for name, values in _FAKE_GPU.items()} for r in range(3)
        ]
    # Rank 0's log line names each extreme with its rank.
    line = next(m for m in results[0]["logged"] if "MnRtt/Rnk" in m)
    for expected in (
        "MnTmp/Rnk: 60.00C/0",
        "MxTmp/Rnk: 80.00C/1",
        "MnPwr/Rnk: 200.00W/2",
        "MxPwr/Rnk: 300.00W/0",
        "MnUtl/Rnk: 10.00%/2",
        "MxUtl/Rnk: 99.00%/1",
        "MnClk/Rnk: 1300.00MHz/1",
        "MxClk/Rnk: 1500.00MHz/2",
    ):
        assert expected in line
    assert not any("MnRtt/Rnk" in m for m in results[1]["logged"] + results[2]["logged"])
