"""A configuration error under torchrun reaches the terminal once, whichever rank fails first.

Before: only rank 0 printed it, so when another rank failed first torchrun stopped rank 0
before it printed, and the user saw "stopped by SIGTERM" and torchrun's ChildFailedError
with no reason. Now every rank writes it to torchrun's error file and torchrun's closing
summary shows it as the root cause, the last lines of the launch.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from bridge.train import cli
from core_utils.testing import run_torchrun

# Runs bridge-train on every rank, the given rank (-1: none) only after a long delay: the other rank
# finds the configuration error first and torchrun stops the slow one.
_SLOW_RANK_LAUNCHER = textwrap.dedent(
    """
    import os, sys, time

    slow_rank = int(sys.argv.pop(1))
    if int(os.environ["RANK"]) == slow_rank:
        time.sleep(240)
    from bridge.train.cli import main

    main()
    """
)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "slow_rank",
    [
        pytest.param(0, id="rank1-fails-first"),
        # Rank 0 first worked before too (it printed in time); kept out of CI's budget.
        pytest.param(1, id="rank0-fails-first", marks=pytest.mark.extended),
        # Both at once (the usual case): each wrote the message and torchrun showed it twice.
        pytest.param(-1, id="both-at-once", marks=pytest.mark.extended),
    ],
)
def test_config_error_is_the_last_thing_torchrun_shows(tmp_path: Path, slow_rank: int) -> None:
    script = tmp_path / "slow_rank_launcher.py"
    script.write_text(_SLOW_RANK_LAUNCHER)
    proc = run_torchrun(
        script, 2, [str(slow_rank), "trian.train_iters=5"], timeout=240, check=False
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    message = "bridge-train: error: trian: unknown section of ConfigContainer"
    assert output.count(message) == 1, output[-3000:]
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip(" =")]
    # torchrun's summary ends with the root cause: its error file holds the message.
    assert lines[-1].startswith(f"traceback : {message}"), lines[-12:]
    assert any(line == "Root Cause (first observed failure):" for line in lines[-10:])


def test_only_the_first_failing_rank_of_an_attempt_writes_the_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # torchrun's layout: <attempt dir>/<local rank>/error.json; it lists every failed rank's
    # error file in its summary, so the message is written by one rank only.
    message = "bridge-train: error: trian: unknown section of ConfigContainer"
    files = []
    for rank in ("1", "0"):  # rank 1 finds it first
        error_file = tmp_path / "attempt_0" / rank / "error.json"
        error_file.parent.mkdir(parents=True)
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        monkeypatch.setenv("RANK", rank)
        cli._report_config_error(message)
        files.append(json.loads(error_file.read_text())["message"])
    assert capsys.readouterr().err == ""  # torchrun shows it, no rank prints it
    first, other = files
    assert first["message"] == message
    assert other["message"].startswith("bridge-train: stopped by a configuration error too")
    # torchrun's root cause is the earliest timestamp: the first failure's, by two seconds.
    stamps = [int(f["extraInfo"]["timestamp"]) for f in files]
    assert stamps[0] < stamps[1], stamps
    # A restart is a new attempt directory: its first failure writes the message again.
    error_file = tmp_path / "attempt_1" / "0" / "error.json"
    error_file.parent.mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    cli._report_config_error(message)
    assert json.loads(error_file.read_text())["message"]["message"] == message
