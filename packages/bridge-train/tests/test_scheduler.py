"""Scheduler lengths in samples, as megatron counts them, and megatron's scheduler on top."""

from __future__ import annotations

import pytest
import torch

from bridge.config import SchedulerConfig, TrainingConfig
from bridge.train.engine.scheduler import build_optimizer_param_scheduler, scheduler_steps
from bridge.train.testing import tiny_optimizer_config


def test_steps_are_iterations_times_global_batch() -> None:
    train = TrainingConfig(train_iters=100, global_batch_size=8, micro_batch_size=2)
    steps = scheduler_steps(SchedulerConfig(lr_warmup_iters=10, lr_decay_iters=80), train)
    assert steps == {
        "lr_warmup_steps": 80,
        "lr_decay_steps": 640,
        "wd_incr_steps": 800,
        "wsd_decay_steps": None,
    }
    frac = scheduler_steps(SchedulerConfig(lr_warmup_fraction=0.25), train)
    assert frac["lr_warmup_steps"] == 200 and frac["lr_decay_steps"] == 800


def test_steps_from_samples_and_from_validated_fields() -> None:
    train = TrainingConfig(train_samples=1000, global_batch_size=10, micro_batch_size=2)
    steps = scheduler_steps(SchedulerConfig(lr_warmup_samples=100), train)
    assert steps["lr_decay_steps"] == 1000 and steps["lr_warmup_steps"] == 100
    filled = SchedulerConfig()
    filled.lr_decay_steps, filled.lr_warmup_steps, filled.wd_incr_steps = 50, 5, 50
    assert scheduler_steps(filled, None)["lr_decay_steps"] == 50


def test_inconsistent_or_missing_lengths_are_explained() -> None:
    with pytest.raises(ValueError, match=r"set train.train_iters"):
        scheduler_steps(SchedulerConfig(), TrainingConfig(global_batch_size=4, micro_batch_size=1))
    train = TrainingConfig(train_iters=10, global_batch_size=4, micro_batch_size=1)
    with pytest.raises(ValueError, match=r"warmup .* must be shorter than the decay"):
        scheduler_steps(SchedulerConfig(lr_warmup_iters=10), train)


def test_megatron_scheduler_drives_param_groups_with_wd_mult() -> None:
    w = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW(
        [{"params": [w], "wd_mult": 1.0}, {"params": [b], "wd_mult": 0.0}], lr=1.0
    )
    train = TrainingConfig(train_iters=10, global_batch_size=4, micro_batch_size=1)
    scheduler = build_optimizer_param_scheduler(
        optimizer,
        tiny_optimizer_config(lr=1e-2, min_lr=1e-3, weight_decay=0.1),
        SchedulerConfig(lr_warmup_iters=2, lr_decay_style="linear"),
        train,
    )
    assert optimizer.param_groups[0]["lr"] == 0.0  # warm-up starts at lr_warmup_init
    scheduler.step(8)  # two iterations of 4 samples: end of warm-up
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2)
    scheduler.step(32)  # end of decay
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [pytest.approx(0.1), 0.0]
