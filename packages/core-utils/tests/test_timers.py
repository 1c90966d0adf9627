"""Timers: single-process behaviour and cross-rank reporting over gloo."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from core_utils import Timers
from core_utils.testing import run_distributed
from core_utils.timers import DummyTimer, Timer


class _Writer:
    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))


class _WandbLike:
    def __init__(self) -> None:
        self.logged: list[tuple[dict[str, float], int]] = []

    def log(self, data: dict[str, float], step: int) -> None:
        self.logged.append((data, step))


def test_timer_accumulates_and_resets() -> None:
    timers = Timers(log_level=2, log_option="minmax")
    timer = timers("step")
    assert isinstance(timer, Timer)
    assert timers("step") is timer
    for _ in range(2):
        timer.start()
        time.sleep(0.01)
        timer.stop()
    elapsed = timer.elapsed(reset=False)
    assert elapsed >= 0.02
    assert timer.elapsed(reset=True) == elapsed
    assert timer.elapsed() == 0.0
    assert timer.active_time() >= 0.02  # reset keeps the active time


def test_elapsed_of_a_running_timer_keeps_it_running() -> None:
    timer = Timers(2, "max")("t")
    timer.start()
    time.sleep(0.01)
    first = timer.elapsed(reset=True)
    assert first >= 0.01
    time.sleep(0.01)
    timer.stop()
    assert timer.elapsed() >= 0.01


def test_start_and_stop_misuse_is_an_error() -> None:
    timer = Timers(2, "max")("t")
    with pytest.raises(RuntimeError, match="'t' is not started"):
        timer.stop()
    timer.start()
    with pytest.raises(RuntimeError, match="'t' has already been started"):
        timer.start()


def test_timer_above_the_log_level_is_a_noop_dummy() -> None:
    timers = Timers(log_level=0, log_option="max")
    dummy = timers("detail", log_level=1)
    assert isinstance(dummy, DummyTimer)
    dummy.start()
    dummy.stop()
    dummy.reset()
    with pytest.raises(RuntimeError, match="'detail' is disabled"):
        dummy.elapsed()
    with pytest.raises(RuntimeError, match="disabled"):
        dummy.active_time()
    assert timers.get_all_timers_string(["detail"]) is None


def test_bad_arguments_are_rejected_with_the_field_name() -> None:
    with pytest.raises(ValueError, match=r"log_option must be one of .* got 'median'"):
        Timers(1, "median")
    with pytest.raises(ValueError, match=r"log_level must be in 0\.\.2, got 3"):
        Timers(3, "max")
    timers = Timers(2, "max")
    timers("a", log_level=1)
    with pytest.raises(ValueError, match="created with log_level=1, got log_level=2"):
        timers("a", log_level=2)
    with pytest.raises(ValueError, match="exceeds the maximum 2"):
        timers("b", log_level=5)
    with pytest.raises(ValueError, match="normalizer must be > 0"):
        timers.log(["a"], normalizer=0.0)
    with pytest.raises(TypeError, match="list of timer names"):
        timers.log("a")


def test_single_process_log_and_write_without_distributed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert not dist.is_initialized()
    timers = Timers(2, "minmax")
    timers("fwd").set_elapsed(0.5)  # type: ignore[attr-defined]
    timers("bwd").set_elapsed(1.5)  # type: ignore[attr-defined]
    report = timers.log(["fwd", "bwd"], normalizer=0.5, reset=False)
    assert report is not None
    assert report.startswith("(min, max) time across ranks (ms):")
    assert "fwd " in report and "(1000.00, 1000.00)" in report
    assert "(3000.00, 3000.00)" in report
    assert capsys.readouterr().out.strip() == report
    writer = _Writer()
    timers.write(["fwd", "bwd"], writer, iteration=7, normalizer=2.0)
    assert writer.scalars == [("fwd-time", 0.25, 7), ("bwd-time", 0.75, 7)]
    # write() reset the timers: nothing left to report.
    assert timers.get_all_timers_string() is None
    timers("fwd").set_elapsed(2.0)  # type: ignore[attr-defined]
    wandb_like = _WandbLike()
    timers.write(None, wandb_like, iteration=3)
    assert wandb_like.logged == [({"fwd-time": 2.0}, 3)]
    timers("fwd").set_elapsed(1.0)  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="neither add_scalar"):
        timers.write(["fwd"], object(), iteration=1)


def _timers_on_ranks(rank: int, world_size: int) -> dict[str, object]:
    out: dict[str, object] = {}
    for option in ("max", "minmax", "all"):
        timers = Timers(log_level=1, log_option=option)
        timer = timers("work", log_level=1)
        # Deterministic per-rank times: rank r "worked" (r + 1) * 100 ms.
        timer.set_elapsed((rank + 1) * 0.1)  # type: ignore[attr-defined]
        timers("only-rank-0", log_level=0).set_elapsed(0.3 if rank == 0 else 0.0)  # type: ignore[attr-defined]
        timers("disabled", log_level=2).start()  # dummy: never reported
        out[option] = timers.get_all_timers_string(
            ["work", "only-rank-0", "disabled"], reset=False, barrier=True
        )
        out[f"{option}-log"] = timers.log(["work"], normalizer=2.0, reset=False)
        out[f"{option}-log0"] = timers.log(["work"], rank=0, reset=False)
        writer = _Writer() if rank == world_size - 1 else None
        timers.write(["work", "only-rank-0"], writer, iteration=5)
        out[f"{option}-write"] = writer.scalars if writer else None
    real = Timers(2, "max")
    real("barrier-timer").start(barrier=True)
    time.sleep(0.01)
    real("barrier-timer").stop(barrier=True)
    out["minmax_dict"] = real.min_max_times(["barrier-timer"])
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_log_options_across_three_gloo_ranks() -> None:
    results = run_distributed(_timers_on_ranks, 3, timeout=100)
    last = results[2]
    assert last["max"] == (
        "max time across ranks (ms):\n"
        f"    {'work '.ljust(48, '.')}: 300.00\n"
        f"    {'only-rank-0 '.ljust(48, '.')}: 300.00"
    )
    assert last["minmax"] == (
        "(min, max) time across ranks (ms):\n"
        f"    {'work '.ljust(48, '.')}: (100.00, 300.00)\n"
        f"    {'only-rank-0 '.ljust(48, '.')}: (300.00, 300.00)"
    )
    assert last["all"] == (
        "times across ranks (ms):\n  work:\n     rank  0: 100.00\n     rank  1: 200.00\n"
        "     rank  2: 300.00\n  only-rank-0:\n     rank  0: 300.00"
    )
    # log() prints on the last rank by default, or on the rank asked for.
    assert last["minmax-log"] is not None and "(50.00, 150.00)" in last["minmax-log"]
    assert results[0]["minmax-log"] is None and results[1]["minmax-log"] is None
    assert results[0]["max-log0"] is not None and last["max-log0"] is None
    for option in ("max", "minmax", "all"):
        assert last[f"{option}-write"] == [
            ("work-time", pytest.approx(0.3), 5),
            ("only-rank-0-time", pytest.approx(0.3), 5),
        ]
    mn, mx = results[0]["minmax_dict"]["barrier-timer"]
    assert 0.0 < mn <= mx
