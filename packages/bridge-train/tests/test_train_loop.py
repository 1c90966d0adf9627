"""The training loop's features, each exercised by a real run of ``pretrain``.

Launches (forked gloo ranks): one rank with batch-size ramp-up, manual GC, the torch profiler,
evaluation and FLOP counting; one rank stopped by SIGTERM and resumed (progress log, job
throughput); two ranks whose weights are made to diverge (weight-hash check, straggler
reports). The small helpers (hook toggling, ramp-up schedule, progress-log parsing) are
checked without processes.
"""

from __future__ import annotations

import gc
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import pytest
import torch
from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator

from bridge.config import (
    CheckpointConfig,
    ConfigError,
    LoggerConfig,
    ProfilingConfig,
    StragglerDetectionConfig,
    TrainingConfig,
)
from bridge.resiliency import WatchdogTimeouts
from bridge.train import (
    disable_forward_pre_hook,
    enable_forward_pre_hook,
    forward_step,
    get_start_time_from_progress_log,
    pretrain,
    should_disable_forward_pre_hook,
)
from bridge.train.loop import rampup_to_step_schedule
from bridge.train.loop.batch_size import ensure_num_microbatches_calculator
from bridge.train.loop.components import WeightHashMismatchError
from bridge.train.loop.step import TrainStep
from bridge.train.metrics import read_metrics_file
from bridge.train.metrics.flops import num_floating_point_operations
from bridge.train.testing import (
    tiny_config_container,
    tiny_gpt_provider,
    tiny_scheduler_config,
    tiny_train_config,
)
from core_utils.testing import DistributedTestError, find_free_port, run_distributed

# --------------------------------------------------------------------------- helpers


class _HookedChunk:
    """Records the forward pre-hook calls megatron's DDP would receive."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def enable_forward_pre_hook(self) -> None:
        self.calls.append(("enable", None))

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        self.calls.append(("disable", param_sync))

    def _copy_main_params_to_param_buffer(self) -> None:
        self.calls.append(("copy", None))


class _HookedOptimizer(_HookedChunk):
    def zero_grad(self) -> None:
        pass

    def step(self) -> tuple[bool, None, None]:
        return True, None, None


def test_forward_pre_hook_helpers() -> None:
    assert should_disable_forward_pre_hook(False, True, True)
    for flags in [(True, True, True), (False, False, True), (False, True, False)]:
        assert not should_disable_forward_pre_hook(*flags)
    chunk, plain = _HookedChunk(), torch.nn.Linear(2, 2)
    disable_forward_pre_hook([chunk, plain], param_sync=False)
    enable_forward_pre_hook([chunk, plain])  # chunks without megatron's DDP have no hooks
    assert chunk.calls == [("disable", False), ("enable", None)]
    # The step refills an mxfp8 parameter buffer that reuses the gradient buffer (overlapped
    # gather only).
    optimizer = _HookedOptimizer()
    scheduler = type("Scheduler", (), {"step": lambda self, increment: None})()
    owns = ensure_num_microbatches_calculator(tiny_train_config(), 1)
    try:
        for overlap in (True, False):
            TrainStep(
                forward_step_func=forward_step,
                forward_backward_func=lambda **kwargs: [],
                train=tiny_train_config(),
                model_config=tiny_gpt_provider(),
                ddp_config=SimpleNamespace(
                    reuse_grad_buf_for_mxfp8_param_ag=True, overlap_param_gather=overlap
                ),
            ).run(iter(()), [], optimizer, scheduler)
    finally:
        if owns:
            destroy_num_microbatches_calculator()
    assert optimizer.calls == [("copy", None)]  # with the overlapped gather only


def test_rampup_becomes_megatron_step_schedule() -> None:
    # start 4, +4 every 32/3 samples, up to 16
    assert rampup_to_step_schedule([4, 4, 32], 16) == "0:4 11:8 22:12 32:16"
    assert rampup_to_step_schedule([8, 8, 100], 8) == "0:8"
    # Raw values meet bridge-config's rules: the section's own, then rampup_increments.
    with pytest.raises(ConfigError, match=r"train.rampup_batch_size.*multiple of the increment 5"):
        rampup_to_step_schedule([4, 5, 32], 16)
    with pytest.raises(ConfigError, match=r"start batch size 32 exceeds global_batch_size 16"):
        rampup_to_step_schedule([32, 4, 32], 16)
    for bad in ([4, 4], [0, 4, 32], [4, 4, -1], [4, 4, 0]):
        with pytest.raises(ConfigError, match=r"rampup_batch_size: got .*three positive"):
            rampup_to_step_schedule(bad, 16)
    # megatron-core's step schedules cannot shrink the batch: the launch pass (validate())
    # refuses the combination before anything is built.
    both = TrainingConfig(
        global_batch_size=16,
        micro_batch_size=4,
        train_samples=64,
        rampup_batch_size=[4, 4, 32],
        decrease_batch_size_if_needed=True,
    )
    with pytest.raises(ConfigError, match=r"train.rampup_batch_size.*decrease_batch_size_if"):
        tiny_config_container(train=both).validate(1)


def test_progress_log_start_time_follows_world_size(tmp_path: Path) -> None:
    lines = [
        "2026-01-01 10:00:00\tJob ID: \t# GPUs: 2\tStarting job",
        "2026-01-01 10:05:00\tJob ID: \t# GPUs: 2\tSaved checkpoint\tIteration: 10\t"
        "Job throughput: 1 TFLOP/s/GPU\tCumulative throughput: 1 TFLOP/s/GPU\t"
        "Floating-point operations: 1.000000e+12\tTokens (in billions): 0.1",
        "2026-01-01 11:00:00\tJob ID: \t# GPUs: 1\tStarting job",
        "2026-01-01 11:10:00\tJob ID: \t# GPUs: 1\tSaved checkpoint\tIteration: 20\t"
        "Job throughput: 1 TFLOP/s/GPU\tCumulative throughput: 1 TFLOP/s/GPU\t"
        "Floating-point operations: 3.000000e+12\tTokens (in billions): 0.2",
        "2026-01-01 12:00:00\tJob ID: \t# GPUs: 1\tStarting job",
    ]
    (tmp_path / "progress.txt").write_text("\n".join(lines) + "\n")
    cfg = tiny_config_container(checkpoint=CheckpointConfig(save=str(tmp_path)))
    start, flops = get_start_time_from_progress_log(cfg)  # WORLD_SIZE unset: 1 rank
    assert str(start) == "2026-01-01 11:00:00" and flops == 1e12
    os.environ["WORLD_SIZE"] = "4"
    try:
        with pytest.raises(RuntimeError, match="no 'Starting job' line for world size 4"):
            get_start_time_from_progress_log(cfg)
    finally:
        del os.environ["WORLD_SIZE"]


def test_progress_log_parser_skips_malformed_lines(tmp_path: Path) -> None:
    """Lines the trainer did not write whole (a launch killed mid-write, a hand edit) are
    passed over: the answer is that of the well-formed lines alone."""
    good = [
        "2026-01-01 10:00:00\tJob ID: \t# GPUs: 1\tStarting job",
        "2026-01-01 10:05:00\tJob ID: \t# GPUs: 1\tSaved checkpoint\tIteration: 10\t"
        "Job throughput: 1 TFLOP/s/GPU\tCumulative throughput: 1 TFLOP/s/GPU\t"
        "Floating-point operations: 1.000000e+12\tTokens (in billions): 0.1",
        "2026-01-01 11:00:00\tJob ID: \t# GPUs: 2\tStarting job",
        "2026-01-01 12:00:00\tJob ID: \t# GPUs: 1\tStarting job",
    ]
    malformed = [
        "",
        "my notes about this run",
        "2026-01-01 11:30:00\tJob ID: \t# GPUs: two\tStarting job",  # world size not a number
        "2026-01-01 11:31:00\tJob ID: \t# GPUs: 2",  # cut before the kind
        "2026-01-01 11:32:00\tJob ID: \tGPUs 2\tStarting job",  # no '# GPUs:' field
        "2026-01-01 11:3",  # cut in the time
        "2026-01-01 11:4\tJob ID: \t# GPUs: 1\tStarting job",  # time cut, rest intact
        "2026-01-01 11:45:00\tJob ID: \t# GPUs: 1\tSaved checkpoint\tIteration: 15\t"
        "Floating-point operations: 2.0e+",  # cut in the FLOPs
    ]
    cfg = tiny_config_container(checkpoint=CheckpointConfig(save=str(tmp_path)))
    (tmp_path / "progress.txt").write_text("\n".join(good) + "\n")
    expected = get_start_time_from_progress_log(cfg)
    assert str(expected[0]) == "2026-01-01 12:00:00" and expected[1] == 1e12
    mixed = [good[0], *malformed[:4], good[1], good[2], *malformed[4:], good[3], malformed[5]]
    (tmp_path / "progress.txt").write_text("\n".join(mixed))  # no final newline either
    assert get_start_time_from_progress_log(cfg) == expected


# --------------------------------------------------------------------------- one rank

_CAPTURED: dict[str, Any] = {}


def _capturing_forward_step(state: Any, data_iterator: Any, model: Any) -> Any:
    _CAPTURED["state"] = state
    if model.training:  # training steps (evaluation after train() runs with GC back on)
        _CAPTURED.setdefault("gc_enabled_in_step", set()).add(gc.isenabled())
    return forward_step(state, data_iterator, model)


def _features_run(rank: int, world: int, tmp: str) -> dict[str, Any]:
    collected_at: list[int] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        state = _CAPTURED.get("state")
        if phase == "start" and info["generation"] == 2 and state is not None:
            collected_at.append(state.train_state.step)

    cfg = tiny_config_container(
        train=tiny_train_config(
            train_iters=None,
            train_samples=40,
            micro_batch_size=2,
            global_batch_size=6,
            rampup_batch_size=[2, 2, 12],
            eval_interval=5,
            eval_iters=1,
            manual_gc=True,
            manual_gc_interval=3,
            train_sync_interval=2,
            empty_unused_memory_level=2,
        ),
        scheduler=tiny_scheduler_config(lr_warmup_iters=0, lr_warmup_samples=4),
        logger=LoggerConfig(log_interval=2, tensorboard_dir=f"{tmp}/tb"),
        profiling=ProfilingConfig(
            use_pytorch_profiler=True, profile_step_start=2, profile_step_end=4, profile_ranks=[0]
        ),
    )
    gc.callbacks.append(on_gc)
    try:
        code = pretrain(cfg, _capturing_forward_step, metrics_file=f"{tmp}/metrics.jsonl")
    finally:
        gc.callbacks.remove(on_gc)
    state = _CAPTURED["state"]
    sizes = [2, 2, 2, 4, 4, 6, 6, 6, 6, 6]
    expected_flops = sum(num_floating_point_operations(cfg.model, b) for b in sizes)
    return {
        "code": code,
        "step": state.train_state.step,
        "consumed": state.train_state.consumed_train_samples,
        "consumed_valid": state.train_state.consumed_valid_samples,
        "flops": state.train_state.floating_point_operations_so_far,
        "expected_flops": expected_flops,
        "gc_enabled_in_step": sorted(_CAPTURED["gc_enabled_in_step"]),
        "gc_enabled_after": gc.isenabled(),
        "collected_at": collected_at,
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_rampup_gc_profiler_evaluation_and_flops(tmp_path: Path) -> None:
    (out,) = run_distributed(_features_run, 1, str(tmp_path), timeout=150)
    assert out["code"] == 0
    # Ramp-up: 2, 2, 2 (until 6 samples), 4, 4 (until 12), then 6 until 40 samples.
    records = read_metrics_file(tmp_path / "metrics.jsonl")
    consumed = {r["step"]: r["samples vs steps"] for r in records if "samples vs steps" in r}
    assert [consumed[s] for s in range(1, 11)] == [2, 4, 6, 10, 14, 20, 26, 32, 38, 44]
    assert out["step"] == 10 and out["consumed"] == 44
    assert out["flops"] == pytest.approx(out["expected_flops"], rel=1e-12)
    # Evaluation at 5 and 10 (validation) and a test pass at the end; 6 samples per eval batch.
    validation = [r["step"] for r in records if "lm loss validation" in r]
    assert validation == [5, 10]
    assert [r["step"] for r in records if "lm loss test" in r] == [10]
    assert out["consumed_valid"] == 12
    # Manual GC: off inside the steps, collections every 3 iterations, back on afterwards.
    assert out["gc_enabled_in_step"] == [False]
    assert {3, 6, 9} <= set(out["collected_at"])
    assert out["gc_enabled_after"]
    # The torch profiler wrote a trace of rank 0 next to the TensorBoard events.
    traces = list((tmp_path / "tb").glob("rank0*.pt.trace.json"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def _signal_run(rank: int, world: int, save: str, kill_at: int | None) -> dict[str, Any]:
    def step(state: Any, data_iterator: Any, model: Any) -> Any:
        _CAPTURED["state"] = state
        due = kill_at is not None and state.train_state.step == kill_at - 1
        if due and not _CAPTURED.get("signalled"):
            _CAPTURED["signalled"] = True
            os.kill(os.getpid(), signal.SIGTERM)  # the handler counts it; training goes on
        return forward_step(state, data_iterator, model)

    cfg = tiny_config_container(
        train=tiny_train_config(train_iters=12, exit_signal_handler=True),
        logger=LoggerConfig(log_interval=4, log_progress=True),
        checkpoint=CheckpointConfig(save=save, save_interval=5),
    )
    code = pretrain(cfg, step)
    state = _CAPTURED["state"]
    return {
        "code": code,
        "step": state.train_state.step,
        "handler_restored": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_exit_signal_saves_once_and_progress_log_spans_launches(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    (first,) = run_distributed(_signal_run, 1, str(save), 7, timeout=120)
    assert first == {"code": 0, "step": 7, "handler_restored": True}
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "7"
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000005", "iter_0000007"]
    time.sleep(1.1)  # progress.txt has 1 s resolution: keep the launches apart
    (second,) = run_distributed(_signal_run, 1, str(save), None, timeout=120)
    assert second["code"] == 0 and second["step"] == 12

    lines = (save / "progress.txt").read_text().splitlines()
    kinds = [line.split("\t")[3] for line in lines]
    assert kinds == ["Starting job", "Saved checkpoint", "Saved checkpoint"] * 2
    saved = [
        dict(f.split(": ", 1) for f in line.split("\t")[4:]) for line in lines if "Saved" in line
    ]
    assert [int(s["Iteration"]) for s in saved] == [5, 7, 10, 12]
    for entry in saved:  # this job's FLOPs over this job's time: never zero
        assert float(entry["Job throughput"].split()[0]) > 0
        assert float(entry["Cumulative throughput"].split()[0]) > 0
    flops = [float(s["Floating-point operations"]) for s in saved]
    assert flops == sorted(flops) and flops[0] > 0
    assert flops[3] == pytest.approx(flops[0] * 12 / 5, rel=1e-6)


# --------------------------------------------------------------------------- two ranks


def _diverging_run(rank: int, world: int) -> dict[str, Any]:
    def step(state: Any, data_iterator: Any, model: Any) -> Any:
        _CAPTURED["state"] = state
        if rank == 1 and state.train_state.step == 2:
            with torch.no_grad():
                next(model.parameters()).add_(1.0)  # a faulty replica
        return forward_step(state, data_iterator, model)

    cfg = tiny_config_container(
        train=tiny_train_config(train_iters=8, check_weight_hash_across_dp_replicas_interval=2),
        logger=LoggerConfig(log_interval=2),
    )
    try:
        pretrain(cfg, step)
    except WeightHashMismatchError as exc:
        return {"error": str(exc), "step": _CAPTURED["state"].train_state.step}
    return {"error": None}


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_weight_hash_mismatch_stops_training_on_every_rank() -> None:
    results = run_distributed(_diverging_run, 2, timeout=150)
    for result in results:
        assert result["error"] is not None, "training went on with diverged replicas"
        assert (
            "iteration 4: the model weights differ across data-parallel replicas"
            in (result["error"])
        )
        assert result["step"] == 4


def _straggler_run(rank: int, world: int, port: int) -> dict[str, Any]:
    cfg = tiny_config_container(
        train=tiny_train_config(train_iters=4, global_batch_size=4, micro_batch_size=2),
        logger=LoggerConfig(log_interval=2),
        straggler=StragglerDetectionConfig(log_straggler=True, straggler_ctrlr_port=port),
    )
    reports: list[Any] = []

    def step(state: Any, data_iterator: Any, model: Any) -> Any:
        reports.append(state.straggler_timing.last_report)
        return forward_step(state, data_iterator, model)

    assert pretrain(cfg, step) == 0
    return {"seen_report": any(r is not None for r in reports)}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_straggler_reports_every_log_interval() -> None:
    results = run_distributed(_straggler_run, 2, find_free_port(), timeout=100)
    assert all(r["seen_report"] for r in results)


def _skip_train_run(rank: int, world: int, tmp: str) -> dict[str, Any]:
    cfg = tiny_config_container(train=tiny_train_config(skip_train=True, eval_iters=1))
    code = pretrain(cfg, _capturing_forward_step, metrics_file=f"{tmp}/metrics.jsonl")
    return {"code": code, "step": _CAPTURED["state"].train_state.step}


def _fault_run(
    rank: int,
    world: int,
    kind: Literal["rank_hung", "rank_killed", "random"],
    hang_timeout: WatchdogTimeouts | None,
) -> int:
    from bridge.config import FaultToleranceConfig

    cfg = tiny_config_container(
        train=tiny_train_config(train_iters=100_000),
        logger=LoggerConfig(log_interval=1000),
        ft=FaultToleranceConfig(
            simulate_fault=True, simulated_fault_type=kind, simulated_fault_rank=0
        ),
    )
    return pretrain(cfg, hang_timeout=hang_timeout)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_skip_train_evaluates_and_simulated_faults_hit_the_rank(tmp_path: Path) -> None:
    (out,) = run_distributed(_skip_train_run, 1, str(tmp_path), timeout=100)
    assert out == {"code": 0, "step": 0}
    records = read_metrics_file(tmp_path / "metrics.jsonl")
    assert {"lm loss validation", "lm loss test"} <= {k for r in records for k in r}
    # ft.simulate_fault: the rank is SIGKILLed about a second after setup ...
    with pytest.raises(DistributedTestError, match=r"exit codes \{0: -9\}"):
        run_distributed(_fault_run, 1, "rank_killed", None, timeout=100)
    # ... or stopped (SIGSTOP); the built-in watchdog (--hang-timeout) then kills it. The
    # stop may land in the warm-up step (under load it often does), which only a setup
    # timeout covers.
    timeouts = WatchdogTimeouts(step=3.0, setup=30.0)
    with pytest.raises(DistributedTestError, match=r"exit codes \{0: -9\}"):
        run_distributed(_fault_run, 1, "rank_hung", timeouts, timeout=100)
