"""The metric writer process: flush barrier, order, back-pressure, errors, crash and exit.

A small file-backed MetricWriter (written to a temporary module, so the writer process can
import it like the built-in backends) stands in for a backend; it records every call as a
JSON line, so each test reads back exactly what ran in the writer process and in which
order.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from bridge.config import LoggerConfig
from bridge.logging import BackendNotInstalledError, MetricWriters, build_metric_writers
from bridge.logging._remote import RemoteMlflow, remote_writers
from bridge.logging._writer_process import WriterProcess
from core_utils.testing import ignored_signals

MODULE = "bridge_logging_test_writers"
WRITERS = textwrap.dedent(
    '''
    import json, os, sys, time
    from bridge.logging.backends import MetricWriter

    class FileWriter(MetricWriter):
        """Appends one JSON line per call; waits for ``gate`` (a file) before writing."""

        kind = "file"
        forwarded = frozenset({"log_metrics", "log_metric"})

        def __init__(self, path, gate=None, fail_on=None, fail_build=False):
            if fail_build:
                raise LookupError("no such store: " + path)
            self.gate, self.fail_on = gate, fail_on
            self.file = open(path, "a")
            self._line({"event": "open", "pid": os.getpid(), "torch": "torch" in sys.modules})

        def _line(self, record):
            self.file.write(json.dumps(record) + "\\n")

        @property
        def backend(self):
            return self.file

        def add_scalar(self, tag, value, step):
            self.log_metrics({tag: value}, step)

        def log_metrics(self, metrics, step):
            while self.gate and not os.path.exists(self.gate):
                time.sleep(0.01)
            if self.fail_on in metrics:
                raise OSError(f"disk full at step {step}")
            self._line({"step": step, **metrics})

        def forward(self, method, args, kwargs):
            if method not in self.forwarded:
                raise AttributeError(f"FileWriter does not forward {method!r}")
            self._line({"call": method, "args": list(args), "kwargs": kwargs})

        def flush(self):
            self._line({"event": "flush"})
            self.file.flush()

        def close(self):
            self._line({"event": "close"})
            self.file.close()
    '''
)


@pytest.fixture
def file_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The factory path of the file writer; its module is importable by the writer process
    (which gets this process's ``sys.path``)."""
    (tmp_path / f"{MODULE}.py").write_text(WRITERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{MODULE}:FileWriter"


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def steps(path: Path) -> list[int]:
    return [r["step"] for r in read(path) if "step" in r]


def wait_until(predicate: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.timeout(180)
def test_full_pipe_blocks_the_producer_order_holds_and_flush_waits(
    tmp_path: Path, file_writer: str
) -> None:
    out, gate = tmp_path / "out.jsonl", tmp_path / "gate"
    process = WriterProcess([("file", file_writer, {"path": str(out), "gate": str(gate)})])
    writers = MetricWriters(remote_writers(process))
    # ~4 KB per record: far more than the pipe (1 MiB) and the writer's batch hold.
    names = [f"layer/{i:03d}/some/long/metric/name" for i in range(100)]
    total, sent = 1500, []

    def produce() -> None:
        for step in range(total):
            writers.log_metrics({name: float(step) for name in names}, step)
            sent.append(step)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    # The writer process holds its first batch until the gate opens: the producer must
    # stop sending once the pipe is full, instead of dropping records or growing a queue.
    previous = -1
    while len(sent) != previous:
        previous = len(sent)
        time.sleep(1.0)
    assert producer.is_alive() and 0 < len(sent) < total
    assert steps(out) == []
    gate.touch()
    producer.join(timeout=120)
    assert not producer.is_alive()
    writers.flush()
    # flush returned after every record was written, in order, then flushed.
    records = read(out)
    assert steps(out) == list(range(total))
    assert records[-1] == {"event": "flush"}
    assert records[0]["torch"] is False  # the writer process runs without torch
    assert records[0]["pid"] == process.pid != os.getpid()
    writers.close()
    writers.close()  # idempotent
    assert read(out)[-1] == {"event": "close"}
    assert process.closed and process._proc.returncode == 0
    with pytest.raises(RuntimeError, match="MetricWriters is closed"):
        writers.add_scalar("x", 1.0, total)


def test_a_writer_error_surfaces_at_the_next_call_and_writing_goes_on(
    tmp_path: Path, file_writer: str
) -> None:
    out = tmp_path / "out.jsonl"
    process = WriterProcess([("file", file_writer, {"path": str(out), "fail_on": "boom"})])
    with MetricWriters(remote_writers(process)) as writers:
        writers.log_metrics({"boom": 1.0}, 1)
        message = r"the file metric writer failed in the writer process while writing step 1: OSError: disk full at step 1"
        with pytest.raises(RuntimeError, match=message):  # the flush barrier reports it
            writers.flush()
        writers.log_metrics({"boom": 1.0}, 2)
        raised = None
        for step in range(3, 2000):  # ... as does a later add_scalar, once it arrived
            try:
                writers.add_scalar("ok", float(step), step)
            except RuntimeError as exc:
                raised = exc
                break
            time.sleep(0.01)
        assert raised is not None and "disk full at step 2" in str(raised)
        writers.add_scalar("ok", 0.5, 5000)  # reported once; the writer goes on
        writers.flush()
    assert steps(out)[-1] == 5000 and 1 not in steps(out) and 2 not in steps(out)


def test_a_dead_writer_process_surfaces_and_close_stays_quiet(
    tmp_path: Path, file_writer: str, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "out.jsonl"
    process = WriterProcess([("file", file_writer, {"path": str(out)})])
    writers = MetricWriters(remote_writers(process))
    writers.add_scalar("x", 1.0, 1)
    writers.flush()
    assert writers.writer_process_pids == (process.pid,)
    os.kill(process.pid, signal.SIGKILL)
    process._proc.wait(timeout=30)
    for call in (lambda: writers.add_scalar("x", 2.0, 2), writers.flush):
        with pytest.raises(
            RuntimeError,
            match=r"the metric writer process \(pid \d+\) was killed by signal 9; its writers \(file\) receive no more metrics",
        ):
            call()
    with caplog.at_level(logging.ERROR, logger="bridge.logging"):
        writers.close()  # never raises after the child died
        writers.close()
    assert "was killed by signal 9" in caplog.text


def test_proxy_calls_run_in_order_with_records_and_explain_what_is_not_forwarded(
    tmp_path: Path, file_writer: str
) -> None:
    out = tmp_path / "out.jsonl"
    # A writer registered as "mlflow" gets the MLflow proxy, as the real one does.
    process = WriterProcess([("mlflow", file_writer, {"path": str(out)})])
    with MetricWriters(remote_writers(process)) as writers:
        proxy = writers.mlflow
        assert isinstance(proxy, RemoteMlflow)
        writers.add_scalar("loss", 2.0, 1)
        # Tensors become floats, though the mlflow signature says float.
        proxy.log_metrics({"moe/aux": torch.tensor(0.5)}, step=1)  # type: ignore[dict-item]
        writers.add_scalar("loss", 1.0, 2)
        writers.flush()
        with pytest.raises(TypeError, match=r"mlflow.log_metrics\(\): an argument cannot be sent"):
            proxy.log_metrics({"bad": lambda: 1}, step=3)  # type: ignore[dict-item]
        with pytest.raises(
            AttributeError,
            match=r"Set logger.metrics_writer_mode=inline to use the mlflow module itself",
        ):
            proxy.active_run()
        proxy.set_tag("team", "nlp")  # not forwarded by this writer: reported, not fatal
        with pytest.raises(RuntimeError, match=r"mlflow.set_tag\(\): AttributeError"):
            writers.flush()
    calls = [r for r in read(out) if "step" in r or "call" in r]
    assert calls == [
        {"step": 1, "loss": 2.0},
        {
            "call": "log_metrics",
            "args": [],
            "kwargs": {"metrics": {"moe/aux": 0.5}, "step": 1, "timestamp": None},
        },
        {"step": 2, "loss": 1.0},
    ]


def test_writers_regrouped_with_a_local_writer_on_a_thread_keep_order_and_close_the_process(
    tmp_path: Path, file_writer: str
) -> None:
    # What bridge-train does to add its metrics file: a new MetricWriters over the built
    # writers plus one of its own, with the calls on a background thread.
    out = tmp_path / "out.jsonl"
    process = WriterProcess([("comet", file_writer, {"path": str(out)})])
    built = MetricWriters(remote_writers(process))
    local = tmp_path / "local.jsonl"
    file_writer_class = importlib.import_module(MODULE).FileWriter  # on sys.path (fixture)
    sys.modules.pop(MODULE)  # each test writes its own copy
    writers = MetricWriters([*built.writers, file_writer_class(str(local))], asynchronous=True)
    for step in range(50):
        writers.add_scalar("loss", float(step), step)
        if step % 10 == 0:  # a proxy call from this thread, between queued records
            writers.comet.log_metrics({"moe": torch.tensor(float(step))}, step=step)
    writers.flush()
    assert steps(out) == steps(local) == list(range(50))
    calls = [r["args"][0]["moe"] for r in read(out) if "call" in r]
    assert calls == [0.0, 10.0, 20.0, 30.0, 40.0]
    lines = read(out)
    assert lines.index({"step": 10, "loss": 10.0}) < next(
        i for i, r in enumerate(lines) if r.get("args") == [{"moe": 10.0}]
    )
    writers.close()
    assert process.closed and read(out)[-1] == {"event": "close"}
    built.close()  # the same writers again: nothing left to do


def test_setup_errors_surface_before_build_returns(
    tmp_path: Path, file_writer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(
        RuntimeError,
        match=r"LookupError: no such store: .*out.jsonl \(in the metric writer process\)",
    ):
        WriterProcess(
            [("file", file_writer, {"path": str(tmp_path / "out.jsonl"), "fail_build": True})]
        )
    with pytest.raises(TypeError, match="cannot be sent to the writer process"):
        WriterProcess([("file", file_writer, {"path": lambda: 1})])

    pytest.importorskip("mlflow")
    pytest.importorskip("comet_ml")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("COMET_API_KEY", raising=False)
    # A tracking URI MLflow cannot use: the error names the experiment and the URI.
    with pytest.raises(
        RuntimeError,
        match=r"MLflow could not start a run in experiment 'e' at tracking URI 'nosuchscheme://x'",
    ):
        build_metric_writers(
            LoggerConfig(mlflow_experiment="e", mlflow_tracking_uri="nosuchscheme://x"),
            rank=0,
            world_size=1,
        )
    # A backend package that is installed here but fails to import in the writer process.
    broken = tmp_path / "broken"
    (broken / "comet_ml").mkdir(parents=True)
    (broken / "comet_ml" / "__init__.py").write_text("raise ImportError('libcomet missing')\n")
    monkeypatch.syspath_prepend(str(broken))
    with pytest.raises(
        BackendNotInstalledError,
        match=r"'comet_ml' package, which failed to import \(libcomet missing\); install it with `pip install bridge-logging\[comet\]`",
    ):
        build_metric_writers(
            LoggerConfig(comet_project="p", comet_offline_dir=str(tmp_path / "comet")),
            rank=0,
            world_size=1,
        )


SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    from bridge.logging import MetricWriters
    from bridge.logging._remote import remote_writers
    from bridge.logging._writer_process import WriterProcess

    factory, out, how = sys.argv[1:]
    process = WriterProcess([("file", factory, {"path": out})])
    writers = MetricWriters(remote_writers(process))
    for step in range(5):
        writers.add_scalar("x", float(step), step)
    print(process.pid, flush=True)
    if how == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    # "exit": leave without closing
    """
)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["exit", "killed"])
def test_writers_left_open_are_closed_when_the_training_process_ends(
    tmp_path: Path, file_writer: str, how: str
) -> None:
    out = tmp_path / "out.jsonl"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, str(script), file_writer, str(out), how],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
    )
    assert done.returncode == (0 if how == "exit" else -signal.SIGKILL), done.stderr
    if how == "exit":  # atexit closed the writers before the interpreter ended
        assert read(out)[-1] == {"event": "close"}
    else:  # the writer process saw its pipe close, wrote what was queued and closed
        wait_until(lambda: out.exists() and read(out)[-1] == {"event": "close"})
    assert steps(out) == [0, 1, 2, 3, 4]
    pid = int(done.stdout.split()[0])
    wait_until(lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid))


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2}


@pytest.mark.timeout(120)
def test_the_writer_process_outlives_the_signals_a_scheduler_stops_a_job_with(
    tmp_path: Path, file_writer: str
) -> None:
    # srun delivers a time-limit SIGUSR1 to every process of a SLURM step, this one too; the
    # training process decides when logging ends.
    out = tmp_path / "out.jsonl"
    process = WriterProcess([("file", file_writer, {"path": str(out)})])
    writers = MetricWriters(remote_writers(process))
    try:
        writers.add_scalar("x", 1.0, 1)
        writers.flush()  # the child has set up its signal handling by now
        assert ignored_signals(process.pid) >= STOP_SIGNALS
        for sig in STOP_SIGNALS:
            os.kill(process.pid, sig)
        writers.add_scalar("x", 2.0, 2)
        writers.flush()  # a round trip through the signalled child
    finally:
        writers.close()
    assert steps(out) == [1, 2]
