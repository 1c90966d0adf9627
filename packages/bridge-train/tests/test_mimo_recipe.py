"""The ``mimo`` recipe: its 4-rank split layout, the trainer settings it honours or refuses.

(The recipe's 1- and 2-rank runs and its first refusals are in test_cli.py.)
"""

from __future__ import annotations

import time

import pytest

from bridge.config import ConfigContainer, ConfigError, load_config
from bridge.train.cli import run
from bridge.train.loop.pretrain_mimo import (
    MimoModelConfig,
    check_mimo_config,
    mimo_layout,
    pretrain_mimo,
)
from bridge.train.recipes import recipe_path
from core_utils.testing import run_distributed

SHORT = ["train.train_iters=6", "scheduler.lr_warmup_iters=1"]


def _config(*overrides: str) -> ConfigContainer:
    return load_config(recipe_path("mimo"), [*SHORT, *overrides])


def _spans(layout: object) -> dict[str, tuple[range, int, int]]:
    modules = layout.modules  # type: ignore[attr-defined]
    return {name: (p.rank_range, p.tp, p.dp_size) for name, p in modules.items()}


def test_a_run_config_saved_before_the_recipe_moved_still_loads(tmp_path: object) -> None:
    """run_config.yaml of a MIMO run saved before Nov 2026 names the old module."""
    from pathlib import Path

    text = Path(recipe_path("mimo")).read_text()
    old = text.replace("bridge.train.models.mimo.", "bridge.train.recipes.mimo.")
    assert old != text
    saved = Path(str(tmp_path)) / "run_config.yaml"
    saved.write_text(old)
    assert isinstance(load_config(saved, SHORT).model, MimoModelConfig)


def test_split_layout_of_four_ranks() -> None:
    cfg = _config()
    assert isinstance(cfg.model, MimoModelConfig)
    assert cfg.model.layout == "auto" and cfg.model.communicator == "auto"
    # The recipe's default on 4 ranks: encoder DP 2 on ranks 0-1, language TP 2 on 2-3.
    layout = mimo_layout(cfg.model, 4)
    assert _spans(layout) == {"vision": (range(0, 2), 1, 2), "language": (range(2, 4), 2, 1)}
    assert not layout.is_colocated
    check_mimo_config(cfg, world_size=4)  # batch sizes 16 / 8 divide both DP sizes
    dp = _config("model.language_parallel=dp")
    assert isinstance(dp.model, MimoModelConfig)
    assert _spans(mimo_layout(dp.model, 4)) == {
        "vision": (range(0, 2), 1, 2),
        "language": (range(2, 4), 1, 2),
    }
    # Eight ranks: the language model keeps TP 2 and gets DP 2.
    assert _spans(mimo_layout(cfg.model, 8))["language"] == (range(4, 8), 2, 2)
    # A language half of odd size cannot be split in two for TP: it runs data parallel.
    assert _spans(mimo_layout(cfg.model, 6))["language"] == (range(3, 6), 1, 3)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["train.eval_interval=10", "train.eval_iters=5"],
            "train.eval_interval: got 10 with train.eval_iters=5; the MIMO recipe does not "
            "support evaluation: set train.eval_interval=null (or train.eval_iters=0)",
        ),
        (
            ["train.skip_train=true"],
            "train.skip_train: got true; the MIMO recipe does not support it",
        ),
        (
            ["rng.layout_independent_init=false", "rng.data_parallel_random_init=true"],
            "rng.data_parallel_random_init: got true; the MIMO recipe draws every module once "
            "for all its data-parallel ranks and would ignore it",
        ),
        (
            ["rng.te_rng_tracker=true"],
            "rng.te_rng_tracker: got true; the MIMO recipe sets up no CUDA RNG tracker",
        ),
        (
            ["dist.lazy_init=true"],
            "dist.lazy_init: got true; bridge-train sets up data parallelism itself",
        ),
        (
            ["dist.use_tp_pp_dp_mapping=true"],
            "dist.use_tp_pp_dp_mapping: got true; the MIMO recipe orders each module's ranks in "
            "its own grid and would ignore it: set dist.use_tp_pp_dp_mapping=false",
        ),
        (
            ["dist.nccl_communicator_config_path=nccl.yaml"],
            "dist.nccl_communicator_config_path: got 'nccl.yaml'; the MIMO recipe applies no "
            "per-communicator NCCL settings and would ignore it: set "
            "dist.nccl_communicator_config_path=null",
        ),
        (
            ["dist.use_sharp=true"],
            "dist.use_sharp: got true; the MIMO recipe does not set up SHARP",
        ),
        (
            ["dist.high_priority_stream_groups=[dp]"],
            "dist.high_priority_stream_groups: got ['dp']; the MIMO recipe sets no communicator "
            "stream priorities and would ignore it: set dist.high_priority_stream_groups=null",
        ),
        (
            ["dist.align_grad_reduce=false"],
            "dist.align_grad_reduce: got false; the MIMO recipe does not overlap gradient "
            "reduction with the backward pass and would ignore it: set "
            "dist.align_grad_reduce=true",
        ),
    ],
)
def test_unsupported_train_settings_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_mimo_config(_config(*overrides), world_size=1)
    assert str(info.value).startswith(message)


def test_supported_or_inactive_train_settings_pass() -> None:
    check_mimo_config(
        _config(
            "train.exit_interval=3",
            "train.exit_duration_in_mins=5",
            "train.exit_signal_handler=true",
            "checkpoint.save=/tmp/unused",
            "checkpoint.load=/tmp/unused",
        ),
        world_size=1,
    )
    # An interval without evaluation batches evaluates nothing: nothing to refuse.
    check_mimo_config(_config("train.eval_interval=10", "train.eval_iters=0"), world_size=1)


def test_the_device_and_experimental_flag_are_chosen_as_for_gpt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The recipe starts its process group as the GPT path does (``start_process_group``):
    the same device choice (local rank modulo the visible devices, or device 0 with
    dist.external_gpu_device_mapping) and flag."""
    import megatron.core.config as megatron_config
    import torch

    import bridge.train.engine.initialize as initialize
    import bridge.train.loop.pretrain_mimo as recipe
    import core_utils
    from bridge.train.testing import tiny_dist_config

    devices: list[int] = []
    monkeypatch.delenv(core_utils.experimental.ENV_VAR, raising=False)
    monkeypatch.setattr(recipe.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    monkeypatch.setattr(initialize, "init_launch_process_group", lambda backend, timeout: None)
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "5")):
        monkeypatch.setenv(name, value)
    experimental = (megatron_config.is_experimental_enabled(), core_utils.is_experimental_enabled())
    assert experimental == (False, False)
    assert recipe.start_process_group is initialize.start_process_group
    try:
        for external in (False, True):
            assert recipe.start_process_group(
                tiny_dist_config(
                    distributed_backend="nccl",
                    external_gpu_device_mapping=external,
                    enable_megatron_core_experimental=external,
                )
            )
            assert (
                megatron_config.is_experimental_enabled(),
                core_utils.is_experimental_enabled(),
            ) == (external, external)
    finally:
        megatron_config.set_experimental_flag(False)
        core_utils.set_experimental_enabled(False)
    assert devices == [1, 0]  # 5 % 4, then device 0


def _four_rank_run(rank: int, world: int) -> int:
    overrides = ["train.exit_interval=4", "logger.log_interval=3"]
    # Stopped before its end on purpose: the code a batch script requeues on.
    return run(
        ["--recipe", "mimo", "--no-print-config", "--requeue-exit-code=75", *SHORT, *overrides]
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_four_rank_split_run_stops_at_the_exit_interval(capfd: pytest.CaptureFixture[str]) -> None:
    assert run_distributed(_four_rank_run, 4, timeout=120) == [75] * 4
    out = capfd.readouterr().out
    assert "'vision': ModulePlacement(ranks=range(0, 2), tp=1, dp=2" in out
    assert "'language': ModulePlacement(ranks=range(2, 4), tp=2, dp=1" in out
    assert "[bridge-train] mimo communicator: p2p (no CUDA in use" in out
    # Logged at 3, then the partial window at the exit; iteration 5 and 6 never run.
    assert "iteration      3 |" in out and "iteration      4 |" in out
    assert "iteration      5 |" not in out
    assert (
        "[bridge-train] exiting after iteration 4: iteration 4 is a multiple of "
        "exit_interval=4" in out
    )
    assert "[bridge-train] mimo: 4 iterations" in out


def _duration_run(rank: int, world: int) -> int:
    cfg = _config("train.exit_duration_in_mins=1", "logger.log_interval=3")
    check_mimo_config(cfg)
    # The job started two minutes ago: the first check ends the run.
    return pretrain_mimo(cfg, start_time=time.time() - 120)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_exit_duration_ends_the_run(capfd: pytest.CaptureFixture[str]) -> None:
    assert run_distributed(_duration_run, 1, timeout=120) == [0]
    out = capfd.readouterr().out
    assert "exiting after iteration 1: the run lasted 2.0" in out
    assert "> exit_duration_in_mins=1" in out
    assert "iteration      1 |" in out and "iteration      2 |" not in out
    assert "[bridge-train] mimo: 1 iterations" in out
