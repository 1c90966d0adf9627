"""log_validation_results: console block, perplexity, TensorBoard tags and their switch."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from bridge.logging import (
    MetricWriters,
    build_metric_writers,
    log_validation_results,
    validation_line,
)
from bridge.logging.validation import perplexity


def _state(kit: Any, tmp_path: Path, ppl: bool) -> Any:
    cfg = kit.make_config(
        tensorboard_dir=str(tmp_path / "tb"), log_validation_ppl_to_tensorboard=ppl
    )
    writers = build_metric_writers(cfg.logger, rank=0, world_size=1)
    return kit.RunState(
        cfg=cfg,
        train_state=kit.Progress(step=10, consumed_train_samples=40),
        timers=None,
        metric_writers=writers,
    )


def test_console_block_and_tags_with_perplexity(kit: Any, tmp_path: Path, capsys: Any) -> None:
    state = _state(kit, tmp_path, ppl=True)
    line = log_validation_results(
        "iteration 10",
        {"lm loss": torch.tensor(math.log(10.0)), "aux": 25.0},
        10,
        state,
        log_ppl=True,
    )
    state.metric_writers.close()
    assert line == (
        " validation loss at iteration 10 | lm loss value: 2.302585E+00 | lm loss PPL: 1.000000E+01 | "
        "aux value: 2.500000E+01 | aux PPL: 4.851652E+08 | "
    )
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["-" * (len(line) + 1), line, "-" * (len(line) + 1)]
    # The line alone (what the print-only evaluation prints), from the same losses.
    assert validation_line("iteration 10", {"lm loss": math.log(10.0), "aux": 25.0}) == line
    tags = kit.read_tensorboard(tmp_path / "tb")
    assert tags["lm loss validation"] == [(10, pytest.approx(math.log(10.0)))]
    assert tags["lm loss validation vs samples"] == [(40, pytest.approx(math.log(10.0)))]
    assert tags["lm loss validation ppl"] == [(10, pytest.approx(10.0))]
    assert tags["lm loss validation ppl vs samples"] == [(40, pytest.approx(10.0))]
    # Perplexity is capped at exp(20), as Megatron does.
    assert tags["aux validation ppl"] == [(10, pytest.approx(math.exp(20.0), rel=1e-6))]


def test_perplexity_tags_follow_the_switch_and_test_split(
    kit: Any, tmp_path: Path, capsys: Any
) -> None:
    state = _state(kit, tmp_path, ppl=False)
    line = log_validation_results(
        "the end", {"lm loss": 1.0}, 12, state, split="test", log_ppl=False
    )
    state.metric_writers.close()
    assert line.startswith(" test loss at the end | lm loss value: 1.000000E+00 |")
    tags = kit.read_tensorboard(tmp_path / "tb")
    assert set(tags) == {"lm loss test", "lm loss test vs samples"}


def test_ranks_without_writers_print_nothing_to_tensorboard(kit: Any, tmp_path: Path) -> None:
    state = _state(kit, tmp_path, ppl=True)
    state.metric_writers.close()
    state.metric_writers = MetricWriters()
    assert "lm loss value" in log_validation_results("it 1", {"lm loss": 1.0}, 1, state)
    with pytest.raises(ValueError, match="split must be a non-empty name"):
        log_validation_results("it 1", {"lm loss": 1.0}, 1, state, split=" ")


def test_perplexity_values() -> None:
    assert perplexity(0.0) == 1.0
    assert perplexity(-1.0) == pytest.approx(math.exp(-1.0))
    assert perplexity(1e6) == math.exp(20.0)
