"""The training step and loop: setup errors, FLOPs, logging, LR scheduling, resume."""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

import bridge.mimo as mimo
from core_utils.callbacks import Callback
from core_utils.testing import run_distributed

FAN_IN = {"vision": {"ranks": range(0, 2), "dp": 2}, "language": {"ranks": range(2, 4), "tp": 2}}
COLOCATED = {"vision": {"ranks": range(0, 2), "dp": 2}, "language": {"ranks": range(0, 2), "dp": 2}}


def _setup_errors(rank: int, world_size: int, harness: SimpleNamespace) -> dict[str, str]:
    layout = {"vision": {"ranks": range(0, 2), "dp": 2}, "language": {"ranks": [2]}}
    infra = mimo.build_megatron_mimo_infra(harness.make_layout(layout))
    model = mimo.build_mimo_model(infra, **mimo.tiny_vlm_specs(harness.CONFIG, infra))
    optimizer = mimo.build_multimodule_optimizer(model, infra, harness.sgd)
    messages: dict[str, str] = {}

    def capture(key: str, error: type[Exception], fn: Any) -> None:
        with pytest.raises(error) as info:
            fn()
        messages[key] = str(info.value)

    capture(
        "batch",
        ValueError,
        lambda: mimo.MimoTrainStep(
            model, infra, optimizer, global_batch_size=6, micro_batch_size=3
        ),
    )
    capture(
        "communicator",
        ValueError,
        lambda: mimo.MimoTrainStep(
            model, infra, optimizer, global_batch_size=4, micro_batch_size=2, communicator="nccl"
        ),
    )
    capture(
        "megatron_without_cuda",
        RuntimeError,
        lambda: mimo.MimoTrainStep(
            model,
            infra,
            optimizer,
            global_batch_size=4,
            micro_batch_size=2,
            communicator="megatron",
        ),
    )
    log_records: list[logging.LogRecord] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            log_records.append(record)

    handler = Capture(logging.INFO)
    step_logger = logging.getLogger("bridge.mimo.training")
    step_logger.addHandler(handler)
    step_logger.setLevel(logging.INFO)
    step = mimo.MimoTrainStep(model, infra, optimizer, global_batch_size=4, micro_batch_size=2)
    step_logger.removeHandler(handler)
    messages["log"] = "\n".join(r.getMessage() for r in log_records)
    # The default, communicator="auto", takes point-to-point without CUDA.
    messages["auto"] = f"{step.communicator_choice.kind} {type(step.communicator).__name__}"
    capture("microbatches", ValueError, lambda: step([{}]))
    specs = mimo.tiny_vlm_specs(harness.CONFIG, infra)
    capture(
        "names",
        ValueError,
        lambda: mimo.build_mimo_model(
            infra,
            **(
                specs
                | {
                    "modality_submodules_spec": {
                        "audio": specs["modality_submodules_spec"]["vision"]
                    }
                }
            ),
        ),
    )
    capture(
        "tokens",
        ValueError,
        lambda: mimo.build_mimo_model(infra, **(specs | {"special_token_ids": {}})),
    )
    wrong_tp = mimo.tiny_vlm_specs(harness.CONFIG, infra)
    wrong_tp["language_model_spec"].params["config"].tensor_model_parallel_size = 2
    capture("tp", ValueError, lambda: mimo.build_mimo_model(infra, **wrong_tp))
    capture(
        "factory",
        TypeError,
        lambda: mimo.build_multimodule_optimizer(
            model,
            infra,
            lambda name, params: object(),  # type: ignore[arg-type, return-value]
        ),
    )
    if rank == 0:
        # An encoder output of the wrong shape is refused before anything is sent (the
        # language rank would otherwise wait for rows that never come).
        counts = torch.tensor([16])
        assert step.communicator is not None
        communicator = step.communicator
        capture(
            "rows",
            ValueError,
            lambda: communicator.send_forward("vision", torch.zeros(15, 32), counts, 0),
        )
    step.close()
    infra.destroy()
    return messages


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_setup_errors_are_clear(harness: SimpleNamespace) -> None:
    results = run_distributed(_setup_errors, 3, harness, timeout=120)
    for messages in results:
        assert messages["batch"] == (
            "micro_batch_size=3 is not divisible by module 'vision''s data-parallel size 2; "
            "use a multiple of 2"
        )
        assert (
            "communicator must be 'auto', 'p2p', 'megatron' or a ModuleCommunicator, got 'nccl'"
            in messages["communicator"]
        )
        assert messages["auto"] == "p2p P2PModuleCommunicator"
        assert "BridgeCommunicator requires CUDA" in messages["megatron_without_cuda"]
        assert "use communicator='p2p'" in messages["megatron_without_cuda"]
        assert messages["microbatches"].startswith("expected 2 micro-batches")
        assert "must return a torch.optim.Optimizer" in messages["factory"]
        assert (
            "modality_submodules_spec names ['audio'] must equal the layout's encoder modules ['vision']"
            in messages["names"]
        )
        assert (
            "special_token_ids has no token for encoder module(s) ['vision']" in messages["tokens"]
        )
        assert messages["tp"].startswith(
            "module 'language': model param 'config' has tensor_model_parallel_size=2 but the "
            "layout gives the module tp=1"
        )
    assert "output of encoder 'vision' has shape (15, 32), expected [16, 32]" in results[0]["rows"]
    # Rank 0 logs the choice and why.
    assert results[0]["log"] == (
        "bridge.mimo communicator: p2p (no CUDA in use: megatron-core's BridgeCommunicator "
        "needs nccl groups and CUDA buffers)"
    )
    assert all(out["log"] == "" for out in results[1:])


def _adamw(_name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def _scheduler(optimizer: mimo.MultiModuleOptimizer, gbs: int) -> OptimizerParamScheduler:
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=1e-3,
        min_lr=1e-4,
        lr_warmup_steps=2 * gbs,
        lr_decay_steps=6 * gbs,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=6 * gbs,
        wd_incr_style="constant",
    )


class _StopAfterTwo(Callback):
    """Records what every hook sees and stops the loop after iteration 2."""

    def __init__(self) -> None:
        self.seen: list[tuple[Any, ...]] = []

    def on_train_start(self, context: mimo.MimoLoopContext) -> None:
        self.seen.append(("start", context.iteration, context.outcome))

    def on_step_start(self, context: mimo.MimoLoopContext) -> None:
        self.seen.append(("step_start", context.iteration))

    def on_step_end(self, context: mimo.MimoLoopContext) -> None:
        assert context.outcome is not None
        same = context.outcome.loss == context.result.losses[-1]
        self.seen.append(("step_end", context.iteration, context.consumed_samples, same))
        if context.iteration == 2:
            context.request_stop("two steps")

    def on_train_end(self, context: mimo.MimoLoopContext) -> None:
        self.seen.append(("end", context.iteration, context.stop_reason))


def _train_log_resume(rank: int, world_size: int, harness: SimpleNamespace, desc: dict) -> dict:
    gbs = harness.GLOBAL_BATCH
    out: dict[str, Any] = {}

    # Four steps straight, logged every two.
    run = harness.build_run(desc, optimizer_factory=_adamw)
    scheduler = _scheduler(run.optimizer, gbs)
    records: list[mimo.MimoLogRecord] = []
    straight = mimo.train_mimo(
        run.step,
        run.data,
        train_iters=4,
        scheduler=scheduler,
        log_fn=records.append,
        log_interval=2,
    )
    out["straight"] = straight.losses
    out["records"] = [
        (r.iteration, r.consumed_samples, r.learning_rate, r.flops_per_iteration, r.as_metrics())
        for r in records
    ]
    out["line"] = records[-1].format()
    out["lr_after_4"] = run.optimizer.param_groups[0]["lr"]
    harness.close_run(run)

    # Two steps, keep every state, rebuild from scratch, load, two more steps.
    first = harness.build_run(desc, optimizer_factory=_adamw)
    first_scheduler = _scheduler(first.optimizer, gbs)
    # A callback ends the run after two of four iterations (request_stop).
    recorder = _StopAfterTwo()
    head = mimo.train_mimo(
        first.step, first.data, train_iters=4, scheduler=first_scheduler, callbacks=[recorder]
    )
    out["hooks"] = recorder.seen
    out["stopped_early"] = head.stopped_early
    saved = {
        "model": copy.deepcopy(first.model.state_dict()),
        "optimizer": first.optimizer.state_dict(),
        "scheduler": first_scheduler.state_dict(),
        "data": first.data.state_dict(),
    }
    harness.close_run(first)
    second = harness.build_run(
        desc, optimizer_factory=_adamw, consumed_samples=saved["data"]["consumed_samples"]
    )
    second.model.load_state_dict(saved["model"])
    second.optimizer.load_state_dict(saved["optimizer"])
    second_scheduler = _scheduler(second.optimizer, gbs)
    second_scheduler.load_state_dict(saved["scheduler"])
    tail = mimo.train_mimo(
        second.step, second.data, train_iters=4, scheduler=second_scheduler, start_iteration=2
    )
    out["resumed"] = head.losses + tail.losses
    out["resumed_iteration"] = (tail.iteration, tail.consumed_samples)
    harness.close_run(second)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_logging_flops_scheduler_and_resume(harness: SimpleNamespace) -> None:
    results = run_distributed(_train_log_resume, 4, harness, FAN_IN, timeout=170)
    reference = results[0]
    for out in results:
        # Every rank reports the same global numbers.
        assert out["straight"] == reference["straight"]
        # Resuming from saved state and a sample count continues the same run exactly.
        torch.testing.assert_close(
            torch.tensor(out["resumed"]), torch.tensor(reference["straight"]), rtol=0, atol=1e-6
        )
        assert out["resumed_iteration"] == (4, 4 * harness.GLOBAL_BATCH)
        gbs = harness.GLOBAL_BATCH
        assert out["stopped_early"]
        assert out["hooks"] == [
            ("start", 0, None),
            ("step_start", 0),
            ("step_end", 1, gbs, True),
            ("step_start", 1),
            ("step_end", 2, 2 * gbs, True),
            ("end", 2, "two steps"),
        ]
    iterations = [r[0] for r in reference["records"]]
    assert iterations == [2, 4]
    assert [r[1] for r in reference["records"]] == [16, 32]
    # Warmup over 2 steps (in samples), then cosine decay: 1e-3 after 2 steps.
    assert reference["records"][0][2] == pytest.approx(1e-3)
    assert reference["lr_after_4"] < 1e-3
    flops = reference["records"][-1][3]
    assert set(flops) == {"vision", "language"}
    assert flops["vision"] > 0 and flops["language"] > 0
    metrics = reference["records"][-1][4]
    for key in (
        "lm loss",
        "learning-rate",
        "grad-norm",
        "iteration-time",
        "throughput/tokens_per_sec",
        "throughput/device/tokens_per_sec",
        "throughput/tflops_per_sec",
        "flops/vision",
        "flops/language",
    ):
        assert key in metrics and metrics[key] > 0, key
    assert "GFLOP/s" in reference["line"] and "iteration      4" in reference["line"]


def _flops_of_layout(rank: int, world_size: int, harness: SimpleNamespace, desc: dict) -> dict:
    run = harness.build_run(desc)
    result = run.step(next(run.data))
    harness.close_run(run)
    return result.flops


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_measured_flops_do_not_depend_on_the_layout(harness: SimpleNamespace) -> None:
    """The same global batch costs the same matmul FLOPs whether the language model is
    split by tensor parallelism on its own ranks or colocated with the encoder."""
    split = run_distributed(_flops_of_layout, 4, harness, FAN_IN, timeout=120)[0]
    colocated = run_distributed(_flops_of_layout, 2, harness, COLOCATED, timeout=120)[0]
    assert sum(split.values()) == pytest.approx(sum(colocated.values()), rel=1e-9)
    # Colocated ranks attribute backward FLOPs by forward share: close, not exact.
    for name in split:
        assert colocated[name] == pytest.approx(split[name], rel=0.15), name
    # Forward + backward of the language model's matmuls, at least 3 x 2 x params x tokens.
    cfg = harness.CONFIG
    layer_params = 12 * cfg.language_hidden_size**2
    tokens = harness.GLOBAL_BATCH * cfg.seq_length
    assert split["language"] >= 3 * 2 * cfg.language_layers * layer_params * tokens
