"""training_log over a few real iterations of a tiny torch model, TensorBoard read back."""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from bridge.config import LoggerConfig, SchedulerConfig, TrainingConfig
from bridge.config.testing import tiny_container
from bridge.logging import (
    MetricWriters,
    ReportSettings,
    TensorBoardWriter,
    build_metric_writers,
    build_timers,
    training_log,
)

GBS = 4
SEQ = 32  # ExampleModelConfig.seq_length


@dataclass
class Driver:
    """Runs iterations of TinyModel and calls training_log like a trainer does."""

    kit: Any
    cfg: Any
    writers: MetricWriters
    flops_per_iteration: float = 3e12
    interval_seconds: float = 2.0
    loaded_iteration: int = 0
    state: Any = None
    total: dict[str, Any] = field(default_factory=dict)
    history: list[float] = field(default_factory=lambda: [0.0])
    flag: bool = True
    flags: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.state = self.kit.make_state(self.cfg, self.writers)
        self.state.train_state.step = self.loaded_iteration
        self.state.train_state.floating_point_operations_so_far = 7e15 * self.loaded_iteration
        self.model = self.kit.TinyModel()
        self.generator = torch.Generator().manual_seed(1)

    def step(
        self, *, loss: float | None = None, skipped: int = 0, batch: int = GBS, **kwargs: Any
    ) -> float:
        ts = self.state.train_state
        x = torch.randn(GBS, 8, generator=self.generator)
        y = torch.randn(GBS, 1, generator=self.generator)
        self.model.zero_grad()
        real = torch.nn.functional.mse_loss(self.model(x), y)
        real.backward()
        # Plain SGD by hand: torch.optim's first step imports torch._dynamo (slow here).
        with torch.no_grad():
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            grad_norm = float(torch.sqrt(sum(g.pow(2).sum() for g in grads)))
            for p in self.model.parameters():
                if p.grad is not None:
                    p -= 1e-3 * p.grad
        value = float(real.detach()) if loss is None else loss
        ts.step += 1
        ts.consumed_train_samples += batch
        ts.floating_point_operations_so_far += self.flops_per_iteration
        self.history.append(float(ts.step - self.loaded_iteration))  # 1 s per iteration
        assert self.cfg.logger is not None
        interval = self.state.timers("interval-time", log_level=0)
        due = ts.step % self.cfg.logger.log_interval == 0
        if due:  # make the interval time exact
            interval.stop()
            interval.set_elapsed(self.interval_seconds)
        args: dict[str, Any] = {
            "learning_rate": 1e-3,
            "decoupled_learning_rate": None,
            "loss_scale": 1.0,
            "grad_norm": grad_norm,
            "params_norm": 12.5,
            "num_zeros_in_grad": 0,
        }
        args.update(kwargs)
        self.flag = training_log(
            {"lm loss": torch.tensor(value)},
            self.total,
            args["learning_rate"],
            args["decoupled_learning_rate"],
            args["loss_scale"],
            self.flag,
            skipped,
            args["grad_norm"],
            args["params_norm"],
            args["num_zeros_in_grad"],
            self.cfg,
            self.state,
            self.history,
            [self.model],
            loaded_iteration=self.loaded_iteration,
        )
        self.flags.append(self.flag)
        if due:
            interval.start()
        return value


def tb_writers(
    tmp_path: Any, cfg: Any, report_settings: ReportSettings | None = None
) -> MetricWriters:
    return build_metric_writers(cfg.logger, rank=0, world_size=1, report_settings=report_settings)


def lines(out: str) -> list[str]:
    return [
        line for line in out.splitlines() if " iteration " in line and "consumed samples" in line
    ]


def field_value(line: str, name: str) -> str:
    match = re.search(rf" {re.escape(name)}: ([^|]+) \|", line)
    assert match, f"{name!r} not in {line!r}"
    return match.group(1).strip()


def test_console_line_and_tensorboard_tags_with_defaults(
    kit: Any, tmp_path: Any, capsys: Any
) -> None:
    cfg = kit.make_config(log_interval=3, tensorboard_dir=str(tmp_path / "tb"))
    writers = tb_writers(tmp_path, cfg)
    driver = Driver(kit, cfg, writers)
    values = [driver.step() for _ in range(6)]
    writers.close()

    out = lines(capsys.readouterr().out)
    assert len(out) == 2
    first, second = out
    assert re.search(r"iteration +3/ +6 \|", first)
    assert field_value(first, "consumed samples") == "12"
    assert field_value(second, "consumed samples") == "24"
    assert field_value(first, "elapsed time per iteration (ms)") == "666.7"
    assert field_value(first, "learning rate") == "1.000000E-03"
    assert field_value(first, "global batch size") == "4"
    assert float(field_value(first, "lm loss")) == pytest.approx(sum(values[:3]) / 3, rel=1e-6)
    assert float(field_value(second, "lm loss")) == pytest.approx(sum(values[3:]) / 3, rel=1e-6)
    assert field_value(first, "loss scale") == "1.0"
    assert field_value(first, "num zeros") == "0"
    assert field_value(first, "number of skipped iterations") == "0"
    assert field_value(first, "number of nan iterations") == "0"
    # Off by default: throughput and the parameter norm.
    assert "throughput per GPU" not in first and "params norm" not in first

    tags = kit.read_tensorboard(tmp_path / "tb")
    assert [v for _, v in tags["lm loss"]] == pytest.approx(values, rel=1e-6)
    assert [s for s, _ in tags["lm loss"]] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in tags["lm loss vs samples"]] == [4, 8, 12, 16, 20, 24]
    assert tags["learning-rate"][0][1] == pytest.approx(1e-3)
    assert tags["batch-size"][0] == (1, 4.0)
    assert tags["loss-scale"][0] == (1, 1.0)
    assert tags["samples vs steps"][-1] == (6, 24.0)
    for present in (
        "learning-rate vs samples",
        "batch-size vs samples",
        "grad-norm",
        "grad-norm vs samples",
        "num-zeros",
        "num-zeros vs samples",
        "loss-scale vs samples",
    ):
        assert present in tags, present
    for absent in ("params-norm", "world-size", "iteration-time", "throughput/tflops/device"):
        assert absent not in tags, absent
    assert not [t for t in tags if t.startswith(("memory/", "throughput/", "time/", "l2_norm/"))]


SWITCHES: list[tuple[dict[str, Any], set[str], set[str], set[str]]] = [
    # logger switches, TB tags present, TB tags absent, console fields present
    ({"log_params_norm": True}, {"params-norm", "params-norm vs samples"}, set(), {"params norm"}),
    (
        {"log_loss_scale_to_tensorboard": False},
        set(),
        {"loss-scale", "loss-scale vs samples"},
        {"loss scale"},
    ),
    (
        {"log_world_size_to_tensorboard": True},
        {"world-size", "world-size vs samples"},
        set(),
        set(),
    ),
    (
        {"log_timers_to_tensorboard": True, "timing_log_level": 1},
        {"forward-backward-time", "iteration-time"},
        set(),
        set(),
    ),
    (
        {"log_throughput": True},
        {"throughput/tflops/device", "throughput/tflops", "throughput/tokens_per_sec"},
        set(),
        {"throughput per GPU (TFLOP/s/GPU)"},
    ),
    ({"log_memory_to_tensorboard": True}, set(), set(), set()),
    ({"log_energy": True}, set(), set(), set()),
]


@pytest.mark.parametrize(
    ("switches", "present", "absent", "console"),
    SWITCHES,
    ids=[next(iter(s[0])) for s in SWITCHES],
)
def test_each_switch_is_honoured(
    kit: Any,
    tmp_path: Any,
    capsys: Any,
    caplog: Any,
    switches: dict[str, Any],
    present: set[str],
    absent: set[str],
    console: set[str],
) -> None:
    cfg = kit.make_config(log_interval=3, tensorboard_dir=str(tmp_path / "tb"), **switches)
    writers = tb_writers(tmp_path, cfg)
    driver = Driver(kit, cfg, writers)
    fb = driver.state.timers("forward-backward", log_level=1)
    with caplog.at_level(logging.INFO, logger="bridge.logging"):
        for _ in range(3):
            fb.start()
            fb.stop()
            driver.step()
    writers.close()
    out = capsys.readouterr().out
    (line,) = lines(out)
    tags = kit.read_tensorboard(tmp_path / "tb")
    assert present <= set(tags), present - set(tags)
    assert not absent & set(tags), absent & set(tags)
    for name in console:
        field_value(line, name)
    if not switches.get("log_params_norm"):
        assert "params norm" not in line
    if "log_memory_to_tensorboard" in switches:
        assert not [t for t in tags if t.startswith("memory/")]
        assert "memory reports need CUDA" in caplog.text or "memory-cpu" in _given_notices()
    if "log_energy" in switches:
        assert "energy" not in line
        assert "energy is not logged" in caplog.text or "energy" in _given_notices()
    if switches.get("timing_log_level") == 1:
        assert "forward-backward" in out  # the timers report of the console interval
    if switches.get("log_throughput"):
        # 3 iterations x 3e12 FLOPs over 2.0 s on one rank.
        assert field_value(line, "throughput per GPU (TFLOP/s/GPU)") == "4.5"
        assert tags["throughput/tflops/device"] == [(3, pytest.approx(4.5))]
        # Window = log_interval = 3 iterations, 1 s each, 4 samples x 32 tokens.
        assert tags["throughput/batches_per_sec"] == [(3, pytest.approx(1.0))]
        assert tags["throughput/tokens_per_sec"] == [(3, pytest.approx(GBS * SEQ))]


def _given_notices() -> set[str]:
    from bridge.logging import _notices

    return _notices._notices_given


def test_tensorboard_log_interval_thins_the_writes(kit: Any, tmp_path: Any, capsys: Any) -> None:
    cfg = kit.make_config(
        log_interval=6, tensorboard_log_interval=2, tensorboard_dir=str(tmp_path / "tb")
    )
    writers = tb_writers(tmp_path, cfg)
    driver = Driver(kit, cfg, writers)
    for _ in range(6):
        driver.step()
    writers.close()
    tags = kit.read_tensorboard(tmp_path / "tb")
    assert [s for s, _ in tags["lm loss"]] == [2, 4, 6]
    assert len(lines(capsys.readouterr().out)) == 1


def test_negative_nan_and_skipped_iterations(kit: Any, tmp_path: Any, capsys: Any) -> None:
    cfg = kit.make_config(log_interval=3, train_iters=6)
    writers = tb_writers(tmp_path, cfg)
    driver = Driver(kit, cfg, writers)
    driver.step(loss=-1.0)
    driver.step(loss=-3.0)
    driver.step(loss=math.nan, skipped=1)  # skipped: not averaged, counted as nan
    driver.step(loss=2.0)
    driver.step(loss=math.inf)  # not skipped: averaged (as Megatron) and counted as nan
    driver.step(loss=4.0)
    first, second = lines(capsys.readouterr().out)
    assert field_value(first, "lm loss") == "-2.000000E+00"
    assert field_value(first, "number of skipped iterations") == "1"
    assert field_value(first, "number of nan iterations") == "1"
    assert field_value(second, "lm loss") == "INF"
    assert field_value(second, "number of skipped iterations") == "0"
    assert field_value(second, "number of nan iterations") == "1"
    # Counters restart each interval; losses leave the accumulator when printed.
    assert driver.total == {"advanced iterations": 0, "skipped iterations": 0, "nan iterations": 0}


def test_throughput_after_resume_uses_only_known_flops(
    kit: Any, tmp_path: Any, capsys: Any
) -> None:
    cfg = kit.make_config(log_interval=3, train_iters=20, log_throughput=True)
    writers = tb_writers(tmp_path, cfg)
    # Resumed at 10: the counter already holds earlier runs' FLOPs, and the first call's
    # own delta is unknown; the interval (iterations 11, 12) is 2 x 3e12 FLOPs over 1 s.
    driver = Driver(kit, cfg, writers, loaded_iteration=10, interval_seconds=1.0)
    driver.step()
    driver.step()
    driver.step()
    driver.step()
    driver.step()
    first, second = lines(capsys.readouterr().out)
    assert field_value(first, "throughput per GPU (TFLOP/s/GPU)") == "6.0"
    assert field_value(second, "throughput per GPU (TFLOP/s/GPU)") == "9.0"


def test_report_memory_flag_turns_off_after_the_second_iteration(
    kit: Any, tmp_path: Any, capsys: Any
) -> None:
    cfg = kit.make_config(log_interval=1, train_iters=3)
    writers = tb_writers(tmp_path, cfg)
    driver = Driver(kit, cfg, writers)
    for _ in range(3):
        driver.step()
    assert driver.flags == [True, False, False]


def test_learning_rate_none_pair_losses_and_bad_shapes(
    kit: Any, tmp_path: Any, capsys: Any
) -> None:
    cfg = kit.make_config(log_interval=1, train_iters=3)
    writers = tb_writers(tmp_path, cfg)
    driver = Driver(kit, cfg, writers)
    driver.step(learning_rate=None, decoupled_learning_rate=5e-4)
    (line,) = lines(capsys.readouterr().out)
    assert field_value(line, "learning rate") == "N/A"
    assert field_value(line, "decoupled learning rate") == "5.000000E-04"

    total: dict[str, Any] = {}
    driver.state.train_state.step = 2
    training_log(
        {"lm loss": torch.tensor([6.0, 3.0])},  # (sum, count) pairs average to 2.0
        total,
        1e-3,
        None,
        1.0,
        False,
        0,
        None,
        None,
        None,
        cfg,
        driver.state,
        [],
        [driver.model],
    )
    assert field_value(lines(capsys.readouterr().out)[0], "lm loss") == "2.000000E+00"
    with pytest.raises(ValueError, match=r"loss_dict\['lm loss'\] has shape \(3,\)"):
        training_log(
            {"lm loss": torch.ones(3)},
            total,
            1e-3,
            None,
            1.0,
            False,
            0,
            None,
            None,
            None,
            cfg,
            driver.state,
            [],
            [driver.model],
        )


def test_missing_sections_are_reported(kit: Any) -> None:
    cfg = tiny_container(logger=None)
    writers = MetricWriters()
    state = kit.RunState(
        cfg=cfg,
        train_state=kit.Progress(step=1),
        timers=build_timers(kit.make_config().logger),
        metric_writers=writers,
    )
    with pytest.raises(ValueError, match=r"config.logger is None"):
        training_log({}, {}, None, None, 1.0, False, 0, None, None, None, cfg, state, [], [])


@pytest.mark.parametrize("configured_by", ["LoggerConfig", "ReportSettings"])
def test_l2_norm_and_runtime_reports_reach_the_writers(
    kit: Any, tmp_path: Any, capsys: Any, configured_by: str
) -> None:
    switches = {}
    settings = None
    if configured_by == "LoggerConfig":
        switches = {
            "log_l2_norm_grad_to_tensorboard": True,
            "log_runtime_to_tensorboard": True,
            "runtime_time_unit": "minutes",
        }
    else:
        settings = ReportSettings(
            log_l2_norm_grad=True, log_runtime=True, runtime_time_unit="minutes"
        )
    cfg = kit.make_config(
        log_interval=2, train_iters=4, tensorboard_dir=str(tmp_path / "tb"), **switches
    )
    writers = tb_writers(tmp_path, cfg, settings)
    driver = Driver(kit, cfg, writers)
    for _ in range(2):
        driver.step()
    writers.close()
    tags = kit.read_tensorboard(tmp_path / "tb")
    expected_global = math.sqrt(
        sum(float(p.grad.pow(2).sum()) for p in driver.model.parameters() if p.grad is not None)
    )
    assert tags["l2_norm/grad/global"][-1] == (2, pytest.approx(expected_global, rel=1e-5))
    assert {"l2_norm/grad/fc1.weight", "l2_norm/grad/fc2.bias"} <= set(tags)
    assert tags["time/batches"][-1] == (2, 2.0)
    assert tags["time/tokens"][-1] == (2, float(2 * GBS * SEQ))
    assert "time/remaining_estimate" in tags


def test_timers_are_built_from_the_logger_section(kit: Any) -> None:
    timers = build_timers(kit.make_config(timing_log_level=2, timing_log_option="all").logger)
    assert (timers.log_level, timers.log_option) == (2, "all")


def test_writer_of_a_custom_backend_receives_the_metrics(
    kit: Any, tmp_path: Any, capsys: Any
) -> None:
    # MetricWriters accepts any MetricWriter; TensorBoardWriter built directly here.
    cfg = kit.make_config(log_interval=1, train_iters=3)
    writer = TensorBoardWriter(tmp_path / "direct", queue_size=5)
    writers = MetricWriters([writer])
    Driver(kit, cfg, writers).step()
    writers.close()
    assert "lm loss" in kit.read_tensorboard(tmp_path / "direct")


def rampup_config(tmp_path: Any, *, ramp_samples: int, **logger: Any) -> Any:
    """Sample-based training whose batch ramps from 2 to 8 by 2 over ``ramp_samples``."""
    cfg = tiny_container(
        train=TrainingConfig(
            micro_batch_size=2,
            global_batch_size=8,
            train_samples=1000,
            rampup_batch_size=[2, 2, ramp_samples],
            eval_interval=None,
        ),
        scheduler=SchedulerConfig(lr_warmup_samples=8),
        logger=LoggerConfig(tensorboard_dir=str(tmp_path / "tb"), **logger),
    )
    cfg.validate(world_size=1)
    return cfg


def test_batch_size_and_throughput_follow_a_rampup(kit: Any, tmp_path: Any, capsys: Any) -> None:
    cfg = rampup_config(tmp_path, ramp_samples=12, log_interval=2, log_throughput=True)
    writers = tb_writers(tmp_path, cfg)
    driver = Driver(kit, cfg, writers)
    batches = [2, 2, 4, 6, 8, 8]  # what the trainer ran (its consumed-sample increments)
    for batch in batches:
        driver.step(batch=batch)
    writers.close()
    printed = lines(capsys.readouterr().out)
    # Each console line shows the batch of the iteration it is printed at.
    assert [field_value(line, "global batch size") for line in printed] == ["2", "6", "8"]
    tags = kit.read_tensorboard(tmp_path / "tb")
    assert tags["batch-size"] == [(i, float(b)) for i, b in enumerate(batches, start=1)]
    consumed = [sum(batches[:i]) for i in range(1, 7)]
    assert tags["batch-size vs samples"] == [
        (c, float(b)) for c, b in zip(consumed, batches, strict=True)
    ]
    # Window of 2 iterations (log_interval), 1 s per iteration: the samples of the last two
    # iterations over 2 s, not 2 x global_batch_size.
    samples_per_sec = [(i, (batches[i - 2] + batches[i - 1]) / 2) for i in range(2, 7)]
    assert tags["throughput/samples_per_sec"] == [(i, pytest.approx(v)) for i, v in samples_per_sec]
    assert tags["throughput/tokens_per_sec"] == [
        (i, pytest.approx(v * SEQ)) for i, v in samples_per_sec
    ]
    assert tags["throughput/batches_per_sec"] == [(i, pytest.approx(1.0)) for i in range(2, 7)]


def test_a_job_resumed_during_the_rampup_does_not_guess_its_first_batch(
    kit: Any, tmp_path: Any, capsys: Any
) -> None:
    cfg = rampup_config(tmp_path, ramp_samples=100, log_interval=1, log_throughput=True)
    writers = tb_writers(tmp_path, cfg)
    driver = Driver(kit, cfg, writers, loaded_iteration=10)
    driver.state.train_state.consumed_train_samples = 20
    for _ in range(3):
        driver.step(batch=4)
    writers.close()
    printed = lines(capsys.readouterr().out)
    # Iteration 11's batch is unknown (the counter before it was not seen, and the batch
    # was still ramping); later ones are the counter's increments.
    assert [field_value(line, "global batch size") for line in printed] == ["N/A", "4", "4"]
    tags = kit.read_tensorboard(tmp_path / "tb")
    assert tags["batch-size"] == [(12, 4.0), (13, 4.0)]
    # The window of iteration 12 holds the unknown iteration: it counts at the known average.
    assert tags["throughput/samples_per_sec"] == [(12, pytest.approx(4.0)), (13, 4.0)]


def test_a_job_resumed_without_rampup_knows_its_first_batch(
    kit: Any, tmp_path: Any, capsys: Any
) -> None:
    cfg = kit.make_config(log_interval=1, train_iters=20, tensorboard_dir=str(tmp_path / "tb"))
    writers = tb_writers(tmp_path, cfg)
    driver = Driver(kit, cfg, writers, loaded_iteration=10)
    driver.state.train_state.consumed_train_samples = 10 * GBS
    driver.step()
    writers.close()
    assert field_value(lines(capsys.readouterr().out)[0], "global batch size") == str(GBS)
    assert kit.read_tensorboard(tmp_path / "tb")["batch-size"] == [(11, float(GBS))]


def test_unknown_sequence_length_leaves_out_only_the_token_metrics(
    kit: Any, tmp_path: Any, capsys: Any
) -> None:
    cfg = kit.make_config(
        log_interval=2,
        train_iters=4,
        tensorboard_dir=str(tmp_path / "tb"),
        log_throughput=True,
        log_runtime_to_tensorboard=True,
    )
    cfg.model.seq_length = None  # e.g. a model config without one, and no dataset
    cfg.dataset = None
    writers = tb_writers(tmp_path, cfg)
    driver = Driver(kit, cfg, writers)
    for _ in range(4):
        driver.step()
    writers.close()
    tags = kit.read_tensorboard(tmp_path / "tb")
    for name in (
        "throughput/batches_per_sec",
        "throughput/samples_per_sec",
        "throughput/device/batches_per_sec",
        "throughput/device/samples_per_sec",
        "throughput/tflops/device",
        "time/remaining_estimate",
        "time/samples",
        "time/batches",
        "time/total",
    ):
        assert name in tags, name
    assert tags["throughput/samples_per_sec"][-1] == (4, pytest.approx(GBS))
    assert tags["time/samples"][-1] == (4, float(4 * GBS))
    assert not [t for t in tags if "tokens" in t]
