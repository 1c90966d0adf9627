"""Runs that would do nothing, or another run's work, say so before training.

* A ``pretrained_checkpoint`` that a resume overrides is named as unused.
* A resumed checkpoint at or past ``train.train_iters`` trains nothing: one line says so.
* Resuming a checkpoint saved with other data, tokenizer or PEFT settings is refused with
  every differing field (``checkpoint.resume_with_changes=true`` continues it anyway); a
  changed model is refused at ``--dry-run`` already. How the data is read may change.
"""

from __future__ import annotations

import logging
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest

from bridge.train.checkpointing.architecture import read_run_config as read
from bridge.train.checks import resume as resume_checks
from bridge.train.cli import EXIT_CONFIG_ERROR, main, run

_SMALL = [
    "train.eval_iters=1",
    "logger.log_interval=1",
    "--no-print-config",
]
_ONE_LAYER = "model.num_layers=1"


def _exit_code(argv: list[str]) -> int:
    try:
        return run(argv)
    except SystemExit as exc:  # argparse
        return int(exc.code or 0)


def _error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == EXIT_CONFIG_ERROR
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("bridge-train: ")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture
def finished_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``runs/a``: a tiny run trained to its end (2 iterations); ``runs/base``: a copy."""
    monkeypatch.chdir(tmp_path)
    assert run([*_SMALL, _ONE_LAYER, "train.train_iters=2", "checkpoint.save=runs/a"]) == 0
    shutil.copytree("runs/a", "runs/base")
    return tmp_path


@pytest.mark.timeout(600)
def test_a_run_that_trains_nothing_says_why(
    finished_run: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    again = [
        *_SMALL,
        _ONE_LAYER,
        "checkpoint.save=runs/a",
        "checkpoint.pretrained_checkpoint=runs/base",
    ]
    two = [*again, "train.train_iters=2"]
    capsys.readouterr()
    assert run(["--dry-run", *two]) == 0
    out = capsys.readouterr().out
    assert "[bridge-train] checkpoint.pretrained_checkpoint=runs/base is not used" in out
    assert "this run resumes iteration 2 of runs/a/iter_0000002" in out
    assert "[bridge-train] nothing to train: the resumed checkpoint" in out
    assert "already reached train.train_iters=2" in out
    assert "raise train.train_iters" in out
    # The launch says the same before it evaluates, once.
    caplog.clear()
    with (
        caplog.at_level(logging.WARNING, logger="bridge.train"),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        assert run(two) == 0
    # torch.distributed.checkpoint's five notes on every load are held back, also those
    # torch attributes to the CUDA emulation's dispatch ("... deprecating ShardedTensor").
    held = [w for w in caught if "torch" in w.filename or "cuda_emulation" in w.filename]
    assert not held, [f"{w.filename}: {w.message}" for w in caught]
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("is not used" in w for w in logged) == 1, logged
    assert sum(w.startswith("nothing to train") for w in logged) == 1, logged
    assert (finished_run / "runs/a/latest_checkpointed_iteration.txt").read_text().strip() == "2"
    # A longer run trains, from its own checkpoint: only the unused weights are named.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="bridge.train"):
        assert run(["--dry-run", *again, "train.train_iters=4"]) == 0
    out = capsys.readouterr().out
    assert "is not used" in out and "nothing to train" not in out


@pytest.mark.timeout(600)
def test_resuming_a_changed_run_is_refused_unless_asked_for(
    finished_run: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    other_model = [*_SMALL, "checkpoint.save=runs/a", "train.train_iters=4", "--dry-run"]
    resume = [*other_model, _ONE_LAYER]
    line = _error_line(capsys, [*resume, "dataset.random_seed=7", "tokenizer.vocab_size=1000"])
    assert line.startswith("bridge-train: error: checkpoint.save: would resume iteration 2 of ")
    assert "dataset.random_seed (saved 1234, this run 7)" in line
    assert "tokenizer.vocab_size (saved" in line and "this run 1000)" in line
    assert "checkpoint.resume_with_changes=true" in line and "a new checkpoint.save" in line
    # Asked for: the differences are listed, the resume goes ahead; the launch check and the
    # notices compare one reading of the saved run_config.yaml.
    capsys.readouterr()
    reads: list[str] = []

    def counted(path: str) -> Any:
        reads.append(path)
        return read(path)

    with monkeypatch.context() as patch:
        patch.setattr(resume_checks, "read_run_config", counted)
        asked = [*resume, "dataset.random_seed=7", "checkpoint.resume_with_changes=true"]
        assert run(asked) == 0
    assert reads == ["runs/a/iter_0000002"], reads
    out = capsys.readouterr().out
    assert "resuming iteration 2 of runs/a/iter_0000002 with changed settings" in out
    assert "dataset.random_seed (saved 1234, this run 7)" in out
    # How the data is read may change freely; so may the length and learning rate.
    assert _exit_code([*resume, "dataset.num_workers=1", "optimizer.lr=1e-3"]) == 0
    # Another model is refused before anything starts (it was refused only at load before).
    line = _error_line(capsys, [*other_model, "model.num_layers=2"])
    assert "num_layers (checkpoint 1, this run 2)" in line and "checkpoint.finetune" in line
