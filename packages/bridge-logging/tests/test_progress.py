"""ProgressReporter: a live rich bar on a terminal, plain lines elsewhere."""

from __future__ import annotations

import io
import os
import pty
import threading
from pathlib import Path

import pytest
from rich.console import Console

from bridge.logging import ProgressReporter, SchedulerJob, append_progress_log, scheduler_job
from bridge.logging.progress import format_duration


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_plain_lines_when_not_a_terminal() -> None:
    buffer = io.StringIO()
    clock = FakeClock()
    console = Console(file=buffer, width=200)
    assert not console.is_interactive
    with ProgressReporter(
        10, console=console, plain_interval=4, enabled=True, clock=clock
    ) as progress:
        assert not progress.live
        for it in range(1, 11):
            clock.now += 2.0  # 2 s per iteration
            progress.update(it, {"lm loss": 3.0 - it / 10})
    assert buffer.getvalue().splitlines() == [
        "[training] 4/10 (40.0%) | elapsed 0:00:08 | ETA 0:00:12 | 0.50 it/s | lm loss: 2.6",
        "[training] 8/10 (80.0%) | elapsed 0:00:16 | ETA 0:00:04 | 0.50 it/s | lm loss: 2.2",
        "[training] 10/10 (100.0%) | elapsed 0:00:20 | ETA 0:00:00 | 0.50 it/s | lm loss: 2",
    ]


def test_plain_eta_after_resume_counts_only_this_job() -> None:
    buffer = io.StringIO()
    clock = FakeClock()
    progress = ProgressReporter(
        100, start=90, console=Console(file=buffer, width=200), enabled=True, clock=clock
    )
    assert progress.plain_interval == 1  # 5% of the 10 remaining iterations, at least 1
    progress.start()
    clock.now += 4.0
    progress.update(92)
    progress.close()
    assert (
        buffer.getvalue().strip()
        == "[training] 92/100 (92.0%) | elapsed 0:00:04 | ETA 0:00:16 | 0.50 it/s"
    )
    with pytest.raises(RuntimeError, match="ProgressReporter is closed"):
        progress.update(93)


def test_live_bar_on_a_forced_terminal() -> None:
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=160)
    with ProgressReporter(5, console=console, enabled=True, description="tiny") as progress:
        assert progress.live
        for it in range(1, 6):
            progress.update(it, {"lm loss": 1.25})
            print(f"console line {it}")  # redirected above the bar
    text = buffer.getvalue()
    assert "\x1b[" in text  # drawn with terminal control sequences
    assert "tiny" in text and "5/5" in text and "lm loss: 1.25" in text
    assert "console line 3" in text
    assert "\n[training]" not in text


def test_disabled_reporter_shows_nothing() -> None:
    buffer = io.StringIO()
    progress = ProgressReporter(3, console=Console(file=buffer), enabled=False)
    progress.start()
    progress.update(3)
    progress.close()
    assert buffer.getvalue() == ""


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="total must be a positive number of iterations, got 0"):
        ProgressReporter(0)
    with pytest.raises(ValueError, match=r"start must be an int in \[0, total=5\], got 6"):
        ProgressReporter(5, start=6)
    with pytest.raises(ValueError, match="plain_interval must be a positive int, got 0"):
        ProgressReporter(5, plain_interval=0)


def test_durations() -> None:
    assert format_duration(0) == "0:00:00"
    assert format_duration(3725.4) == "1:02:05"
    assert format_duration(90000) == "1 day, 1:00:00"
    assert format_duration(-3) == "0:00:00"


def _drive(console: Console) -> bool:
    with ProgressReporter(4, console=console, enabled=True, plain_interval=2) as progress:
        for it in range(1, 5):
            progress.update(it, {"lm loss": 0.5})
    return progress.live


@pytest.mark.timeout(60)
def test_a_real_pseudo_terminal_gets_the_bar_and_a_pipe_gets_lines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "NO_COLOR", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")

    leader, follower = pty.openpty()
    chunks: list[bytes] = []

    def read_all() -> None:
        while True:
            try:
                data = os.read(leader, 4096)
            except OSError:  # the follower side was closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    with os.fdopen(follower, "w", buffering=1) as tty:
        # No force_terminal: rich asks the file whether it is a terminal.
        live = _drive(Console(file=tty, width=120))
    reader.join(timeout=30)
    os.close(leader)
    tty_out = b"".join(chunks).decode(errors="replace")
    assert live
    assert "\x1b[" in tty_out and "4/4" in tty_out and "lm loss: 0.5" in tty_out

    read_fd, write_fd = os.pipe()
    with os.fdopen(write_fd, "w") as pipe:
        live = _drive(Console(file=pipe, width=120))
    with os.fdopen(read_fd) as pipe_out:
        piped = pipe_out.read()
    assert not live
    assert [line.split(" | ")[0] for line in piped.splitlines()] == [
        "[training] 2/4 (50.0%)",
        "[training] 4/4 (100.0%)",
    ]
    assert "\x1b[" not in piped


def test_progress_log_appends_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert append_progress_log(None, "ignored") is None
    path = append_progress_log(tmp_path / "ckpt", "Starting job")
    assert path == tmp_path / "ckpt" / "progress.txt"
    append_progress_log(tmp_path / "ckpt", "Saved checkpoint\tTokens (in billions): 0.01")
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    assert lines[0].split("\t")[1:] == ["Job ID: 4242", "# GPUs: 1", "Starting job"]
    assert lines[1].endswith("Saved checkpoint\tTokens (in billions): 0.01")


def test_the_slurm_job_is_read_from_its_environment() -> None:
    assert scheduler_job({}) is None
    first = scheduler_job({"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-08]"})
    assert first == SchedulerJob(job_id="4242", node_list="gpu[07-08]", requeue_count=0)
    requeued = scheduler_job(
        {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_RESTART_COUNT": "3"}
    )
    assert requeued is not None
    assert requeued.progress_fields() == "Nodes: gpu[07-08]\tRequeue count: 3"
    assert requeued.metrics() == {"slurm/requeue_count": 3.0, "slurm/job_id": 4242.0}
    assert requeued.run_parameters() == {
        "job_id": "4242",
        "node_list": "gpu[07-08]",
        "requeue_count": 3,
    }
    odd = scheduler_job({"SLURM_JOB_ID": "x1", "SLURM_RESTART_COUNT": "?"})
    assert (
        odd is not None and odd.requeue_count == 0 and odd.metrics() == {"slurm/requeue_count": 0.0}
    )
