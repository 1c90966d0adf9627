"""What a user sees between launching and the first loss line, and in a short run."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from bridge.train.cli import run

#: Where the setup steps are announced (the checkpoint load is shared with the mimo recipe).
SETUP_LOGGERS = ("bridge.train.loop.pretrain", "bridge.train.loop.run_ends")


@pytest.mark.timeout(300)
def test_setup_steps_and_the_last_loss_are_shown(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.chdir(tmp_path)
    argv = [
        "train.train_iters=3",  # shorter than log_interval: before, no loss line at all
        "logger.log_interval=10",
        "train.eval_iters=0",
        "model.num_layers=1",
        "checkpoint.save=runs/a",
        "--no-print-config",
    ]
    with caplog.at_level(logging.INFO, logger="bridge.train"):
        assert run(argv) == 0
    steps = [r.getMessage() for r in caplog.records if r.name in SETUP_LOGGERS]
    assert [s.split(" (")[0] for s in steps] == [
        "building the model and optimizer",
        "loading the data",
    ], steps
    out = capsys.readouterr().out
    loss_lines = re.findall(r"iteration +(\d+)/ +3 \|.*lm loss: ([0-9.E+-]+)", out)
    assert [int(i) for i, _ in loss_lines] == [3], out[-2000:]
    # A resume announces the checkpoint before loading it.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="bridge.train"):
        assert run([*argv[1:], "train.train_iters=4"]) == 0
    steps = [r.getMessage() for r in caplog.records if r.name in SETUP_LOGGERS]
    assert [s.split(" (")[0] for s in steps] == [
        "building the model and optimizer",
        "loading the checkpoint",
        "loading the data",
    ], steps
    assert steps[1] == "loading the checkpoint (runs/a)"
