"""The four real backends (offline / local), written through MetricWriters and read back.

Importing wandb, mlflow and comet_ml is slow, so one module-scoped run writes to all of
them and each test reads one backend's output.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import pytest
import torch

from bridge.config import LoggerConfig
from bridge.logging import (
    BackendNotInstalledError,
    BackendSettings,
    MetricWriter,
    MetricWriters,
    build_metric_writers,
    build_moe_metric_writer,
    log_validation_results,
)

pytest.importorskip("wandb")
pytest.importorskip("mlflow")
pytest.importorskip("comet_ml")
pytest.importorskip("tensorboard")


# A table of text (sample completions): a pipe and a line break must survive every backend.
TABLE_ROWS = [["1 + 1 =", " 2\nand | more"], ["Hello", " world"]]


@pytest.fixture(scope="module", params=["process", "inline"])
def written(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, kit: Any
) -> SimpleNamespace:
    """Write the same metrics to all four backends once per writer mode; return where
    they went. Process mode configures everything through LoggerConfig; inline mode passes
    the MLflow / Comet settings as BackendSettings overrides (the older spelling)."""
    mode = request.param
    root = tmp_path_factory.mktemp(f"backends-{mode}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_DIR", str(root / "wandb-env"))
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        mp.delenv("COMET_API_KEY", raising=False)
        mp.delenv("COMET_MODE", raising=False)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        backends: dict[str, Any] = {
            "mlflow_experiment": "bridge-tests",
            "mlflow_tracking_uri": f"file:{root / 'mlruns'}",
            "mlflow_tags": {"team": "nlp"},
            "comet_project": "bridge-tests",
            "comet_offline_dir": str(root / "comet"),
            "comet_tags": ["smoke"],
        }
        logger_cfg = LoggerConfig(
            tensorboard_dir=str(root / "tb"),
            wandb_project="bridge-tests",
            wandb_exp_name="run-1",
            wandb_save_dir=str(root / "wandb"),
            log_validation_ppl_to_tensorboard=True,
            metrics_writer_mode=mode,
            **(backends if mode == "process" else {}),
        )
        writers = build_metric_writers(
            logger_cfg,
            rank=0,
            world_size=1,
            run_config={"train": {"lr": 0.1, "iters": 3}, "name": "tiny"},
            backend_settings=None if mode == "process" else BackendSettings(**backends),
            asynchronous=mode == "inline",  # the backend calls run on the writer thread
        )
        kinds = {
            "tensorboard": type(writers.tensorboard).__name__,
            "wandb": type(writers.wandb).__name__,
            "mlflow": getattr(writers.mlflow, "__name__", type(writers.mlflow).__name__),
            "comet": type(writers.comet).__name__,
        }
        info = {writer.kind: writer.info for writer in writers.writers}
        pids = writers.writer_process_pids
        writers.add_scalar("loss", 1.5, 1)
        writers.log_metrics(
            {
                "loss": 1.25,
                "throughput/tokens_per_sec": torch.tensor(100.0),
                "throughput/tflops": 2.0,
                "throughput/tflops/device": 1.0,
            },
            2,
        )
        # What megatron's MoE helpers do with the objects the trainer hands them.
        moe = build_moe_metric_writer(writers.tensorboard, writers.comet, writers.mlflow)
        assert moe is not None  # MLflow and Comet are configured: the fan-out writer
        moe.add_scalar("load_balancing_loss", torch.tensor(0.5), 3)
        writers.wandb.log({"moe/aux_loss": torch.tensor(0.25)}, 3)
        cfg = kit.make_config(
            tensorboard_dir=logger_cfg.tensorboard_dir, log_validation_ppl_to_tensorboard=True
        )
        state = kit.RunState(
            cfg=cfg,
            train_state=kit.Progress(step=3, consumed_train_samples=12),
            timers=None,
            metric_writers=writers,
        )
        log_validation_results(
            "iteration 3",
            {"lm loss": torch.tensor(2.0)},
            3,
            state,
            log_ppl=cfg.logger.log_validation_ppl_to_tensorboard,
        )
        writers.log_table("samples", ["prompt", "completion"], TABLE_ROWS, 3)
        writers.flush()
        writers.close()
        writers.close()  # idempotent
    return SimpleNamespace(
        mode=mode,
        root=root,
        kinds=kinds,
        pids=pids,
        mlflow_run_id=info["mlflow"]["run_id"],
        mlflow_uri=info["mlflow"]["tracking_uri"],
        comet_offline=info["comet"]["offline"],
        closed=writers.closed,
        enabled_after_close=writers.enabled,
    )


def test_backend_objects_are_exposed(written: SimpleNamespace) -> None:
    if written.mode == "process":  # proxies of the objects living in the writer process
        expected = ["RemoteWandbRun", "RemoteMlflow", "RemoteCometExperiment"]
        assert len(written.pids) == 1
    else:
        expected = ["Run", "mlflow", "OfflineExperiment"]
        assert written.pids == ()
    assert written.kinds == {
        "tensorboard": "SummaryWriter",
        **dict(zip(["wandb", "mlflow", "comet"], expected, strict=True)),
    }
    assert written.closed and not written.enabled_after_close
    assert written.comet_offline


def test_tensorboard_receives_everything(written: SimpleNamespace, kit: Any) -> None:
    tags = kit.read_tensorboard(written.root / "tb")
    assert tags["loss"] == [(1, 1.5), (2, 1.25)]
    assert tags["throughput/tokens_per_sec"] == [(2, 100.0)]
    assert tags["load_balancing_loss"] == [(3, 0.5)]
    assert tags["lm loss validation"] == [(3, 2.0)]
    assert tags["lm loss validation vs samples"] == [(12, 2.0)]
    assert tags["lm loss validation ppl"][0][1] == pytest.approx(7.389056)
    assert "lm loss validation ppl vs samples" in tags


def test_wandb_offline_run_holds_the_history(written: SimpleNamespace, kit: Any) -> None:
    (run_dir,) = (written.root / "wandb" / "wandb").glob("offline-run-*")
    rows = kit.read_wandb_history(run_dir)
    by_step = {row["_step"]: row for row in rows}
    assert by_step[1]["loss"] == 1.5
    assert by_step[2]["loss"] == 1.25 and by_step[2]["throughput/tokens_per_sec"] == 100.0
    assert by_step[3]["lm loss validation"] == 2.0
    assert by_step[3]["lm loss validation ppl"] == pytest.approx(7.389056)
    assert by_step[3]["moe/aux_loss"] == 0.25  # written through writers.wandb.log
    # MoE metrics reach W&B through the run itself, not the fan-out writer.
    assert all("load_balancing_loss" not in row for row in rows)


def test_mlflow_file_store_holds_metrics_and_params(
    written: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")

    client = MlflowClient(tracking_uri=written.mlflow_uri)
    history = client.get_metric_history(written.mlflow_run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(1, 1.5), (2, 1.25)]
    # Slashes become underscores: the file store cannot hold both a/b and a/b/c.
    (tflops,) = client.get_metric_history(written.mlflow_run_id, "throughput_tflops")
    (device,) = client.get_metric_history(written.mlflow_run_id, "throughput_tflops_device")
    assert (tflops.value, device.value) == (2.0, 1.0)
    (moe,) = client.get_metric_history(written.mlflow_run_id, "load_balancing_loss")
    assert (moe.step, moe.value) == (3, 0.5)
    (ppl,) = client.get_metric_history(written.mlflow_run_id, "lm loss validation ppl")
    assert ppl.value == pytest.approx(7.389056)
    run = client.get_run(written.mlflow_run_id)
    assert run.data.params["train.lr"] == "0.1"
    assert run.data.params["name"] == "tiny"
    assert run.data.tags["team"] == "nlp"
    assert run.info.run_name == "run-1"
    assert run.info.status == "FINISHED"


def test_comet_offline_archive_holds_metrics_and_params(written: SimpleNamespace) -> None:
    (archive,) = (written.root / "comet").glob("*.zip")
    with zipfile.ZipFile(archive) as zf:
        messages = [
            json.loads(line) for line in zf.read("messages.json").splitlines() if line.strip()
        ]
        experiment = json.loads(zf.read("experiment.json"))
    assert experiment["project_name"] == "bridge-tests"
    assert "smoke" in experiment["tags"]
    metrics = [
        (
            m["payload"]["metric"]["metricName"],
            m["payload"]["metric"]["step"],
            m["payload"]["metric"]["metricValue"],
        )
        for m in messages
        if m["type"] == "metric_msg"
    ]
    assert ("loss", 1, 1.5) in metrics and ("loss", 2, 1.25) in metrics
    assert ("throughput/tokens_per_sec", 2, 100.0) in metrics
    assert ("load_balancing_loss", 3, 0.5) in metrics
    assert ("lm loss validation", 3, 2.0) in metrics
    params = {
        m["payload"]["param"]["paramName"]: m["payload"]["param"]["paramValue"]
        for m in messages
        if m["type"] == "parameter_msg" and m["payload"]["param"]["source"] == "manual"
    }
    assert params["train.lr"] == 0.1
    others = {
        m["payload"]["key"]: m["payload"]["value"] for m in messages if m["type"] == "log_other"
    }
    assert others["Name"] == "run-1"


def test_tables_reach_every_backend(
    written: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``MetricWriters.log_table``: TensorBoard text, a W&B table, MLflow and Comet files."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(written.root / "tb"), size_guidance={"tensors": 0})
    accumulator.Reload()
    (event,) = accumulator.Tensors("samples/text_summary")
    assert event.step == 3
    assert event.tensor_proto.string_val[0].decode().splitlines() == [
        "| prompt | completion |",
        "|---|---|",
        "| 1 + 1 = |  2<br>and \\| more |",
        "| Hello |  world |",
    ]

    (run_dir,) = (written.root / "wandb" / "wandb").glob("offline-run-*")
    (table_file,) = run_dir.glob("files/media/table/samples_3_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == ["prompt", "completion"] and table["data"] == TABLE_ROWS

    client = MlflowClient(tracking_uri=written.mlflow_uri)
    artifact = client.download_artifacts(
        written.mlflow_run_id, "samples/step_000000003.json", str(written.root / "mlflow-out")
    )
    stored = json.loads(Path(artifact).read_text())
    assert stored == {"columns": ["prompt", "completion"], "data": TABLE_ROWS, "step": 3}

    (archive,) = (written.root / "comet").glob("*.zip")
    with zipfile.ZipFile(archive) as zf:
        messages = [
            json.loads(line) for line in zf.read("messages.json").splitlines() if line.strip()
        ]
        (upload,) = [
            m["payload"]
            for m in messages
            if m["type"] == "file_upload" and "samples" in json.dumps(m["payload"])
        ]
        csv = zf.read(upload["file_path"]).decode()
    assert csv.splitlines()[0] == "prompt,completion"
    assert "Hello, world" in csv


def test_moe_writer_is_the_tensorboard_writer_without_mlflow_or_comet() -> None:
    sentinel = object()
    assert build_moe_metric_writer(sentinel, None, None) is sentinel
    assert build_moe_metric_writer(None, None, None) is None


@pytest.mark.parametrize("mode", ["inline", "process"])
def test_mlflow_logs_into_an_already_active_run_and_leaves_it_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: Literal["inline", "process"]
) -> None:
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file:{tmp_path / 'mlruns'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("outer")
    with mlflow.start_run() as outer:
        writers = build_metric_writers(
            LoggerConfig(
                mlflow_experiment="ignored", mlflow_tracking_uri=uri, metrics_writer_mode=mode
            ),
            rank=0,
            world_size=1,
        )
        assert writers.writers[0].info["run_id"] == outer.info.run_id
        writers.add_scalar("acc", 0.75, 4)
        writers.close()
        assert mlflow.active_run() is not None
        client = mlflow.tracking.MlflowClient(uri)
        history = client.get_metric_history(outer.info.run_id, "acc")
        assert client.get_run(outer.info.run_id).info.status == "RUNNING"
    assert [(m.step, m.value) for m in history] == [(4, 0.75)]


def test_missing_tracking_uri_and_comet_key_are_explained(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(
        ValueError,
        match=r"no tracking URI is set; set LoggerConfig.mlflow_tracking_uri \(e.g. bridge-train "
        r"logger.mlflow_tracking_uri=http://mlflow-server:5000, or file:./mlruns",
    ):
        build_metric_writers(
            LoggerConfig(),
            rank=0,
            world_size=1,
            backend_settings=BackendSettings(mlflow_experiment="e"),
        )
    monkeypatch.delenv("COMET_API_KEY", raising=False)
    with pytest.raises(
        ValueError,
        match=r"Comet online mode for project 'p' needs an API key; export COMET_API_KEY",
    ):
        build_metric_writers(
            LoggerConfig(tensorboard_dir=str(tmp_path / "tb")),
            rank=0,
            world_size=1,
            backend_settings=BackendSettings(comet_project="p", comet_mode="online"),
        )
    # The TensorBoard writer built before the failure was closed, not leaked.
    assert list((tmp_path / "tb").iterdir())


@pytest.mark.parametrize(
    ("logger", "settings", "module", "extra"),
    [
        ({"tensorboard_dir": "tb"}, {}, "tensorboard", "tensorboard"),
        ({"wandb_project": "p"}, {}, "wandb", "wandb"),
        ({}, {"mlflow_experiment": "e"}, "mlflow", "mlflow"),
        ({}, {"comet_project": "p"}, "comet_ml", "comet"),
    ],
)
def test_missing_backend_package_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
    logger: dict[str, Any],
    settings: dict[str, Any],
    module: str,
    extra: str,
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # makes the import fail
    # Both spellings: pip's, and the one that works inside this uv workspace.
    both = (
        rf"`pip install bridge-logging\[{extra}\]` "
        rf"\(in a clone of this repository: `uv sync --inexact --extra {extra}`\)"
    )
    with pytest.raises(BackendNotInstalledError, match=both):
        build_metric_writers(
            LoggerConfig(**logger),
            rank=1,  # not the writer rank: every rank checks
            world_size=2,
            backend_settings=BackendSettings(**settings),
        )


def test_only_the_last_rank_gets_backends(tmp_path: Path) -> None:
    cfg = LoggerConfig(tensorboard_dir=str(tmp_path / "tb"))
    first = build_metric_writers(cfg, rank=0, world_size=2)
    assert not first.enabled and first.tensorboard is None and first.wandb is None
    first.add_scalar("x", 1.0, 1)  # no backends: nothing happens
    assert not (tmp_path / "tb").exists()
    with build_metric_writers(cfg, rank=1, world_size=2) as last:
        assert last.enabled and last.tensorboard is not None
    assert last.closed


def test_bad_arguments_are_explained() -> None:
    with pytest.raises(ValueError, match="rank must be < world_size \\(2\\), got 2"):
        build_metric_writers(LoggerConfig(), rank=2, world_size=2)
    with pytest.raises(
        TypeError, match=r"logger_cfg must be a bridge\.config\.LoggerConfig, got dict"
    ):
        build_metric_writers({}, rank=0, world_size=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="run_config must be a mapping or an object with to_dict"):
        build_metric_writers(LoggerConfig(), rank=0, world_size=1, run_config=42)
    with pytest.raises(TypeError, match="writers must be MetricWriter instances, got str"):
        MetricWriters(["tb"])  # type: ignore[list-item]


class _Recorder(MetricWriter):
    kind = "recorder"

    def __init__(
        self, fail_close: bool = False, fail_log: bool = False, delay: float = 0.0
    ) -> None:
        self.rows: list[tuple[str, float, int]] = []
        self.threads: set[str] = set()
        self.closed = 0
        self.fail_close = fail_close
        self.fail_log = fail_log
        self.delay = delay

    @property
    def backend(self) -> Any:
        return self.rows

    def add_scalar(self, tag: str, value: Any, step: int) -> None:
        if self.fail_log:
            raise OSError("disk full")
        time.sleep(self.delay)
        self.threads.add(threading.current_thread().name)
        self.rows.append((tag, float(value), step))

    def flush(self) -> None:
        self.rows.append(("<flush>", 0.0, -1))

    def close(self) -> None:
        self.closed += 1
        if self.fail_close:
            raise OSError("disk full")


def test_close_is_safe_when_a_backend_fails(caplog: pytest.LogCaptureFixture) -> None:
    broken, healthy = _Recorder(fail_close=True), _Recorder()
    writers = MetricWriters([broken, healthy])
    writers.log_metrics({"a": torch.tensor(1.0), "b": 2}, 5)
    assert healthy.rows == [("a", 1.0, 5), ("b", 2.0, 5)]
    with caplog.at_level(logging.ERROR, logger="bridge.logging"):
        writers.close()
        writers.close()
    assert (broken.closed, healthy.closed) == (1, 1)
    assert "closing the recorder metric writer failed" in caplog.text
    with pytest.raises(RuntimeError, match="MetricWriters is closed"):
        writers.add_scalar("a", 1.0, 6)


class _SlowTensorBoard(_Recorder):
    kind = "tensorboard"


def test_background_thread_keeps_order_and_waits_before_direct_backend_use() -> None:
    slow = _SlowTensorBoard(delay=0.02)
    writers = MetricWriters([slow], asynchronous=True)
    assert writers.asynchronous
    for step in range(5):
        writers.log_metrics({"a": torch.tensor(float(step))}, step)
    # Reading the backend waits for the queued calls, so direct writes come after them.
    assert writers.tensorboard is slow.rows
    assert slow.rows == [("a", float(s), s) for s in range(5)]
    assert slow.threads == {"bridge-logging-writers"}
    # Bad values are still rejected in the caller.
    with pytest.raises(ValueError, match=r"metric 'a': got a tensor of shape \(2,\)"):
        writers.log_metrics({"a": torch.ones(2)}, 5)
    writers.close()
    assert slow.closed == 1


def test_background_errors_surface_at_the_next_call(caplog: pytest.LogCaptureFixture) -> None:
    broken = _Recorder(fail_log=True)
    writers = MetricWriters([broken], asynchronous=True)
    writers.log_metrics({"a": 1.0}, 1)
    with pytest.raises(
        RuntimeError, match=r"a metric writer failed in the background: OSError\('disk full'\)"
    ):
        writers.flush()
    writers.log_metrics({"a": 2.0}, 2)
    with caplog.at_level(logging.ERROR, logger="bridge.logging"):
        writers.close()  # never raises; the pending error is logged
    assert "a metric writer failed before close" in caplog.text
    assert broken.closed == 1


def test_values_must_be_single_numbers(tmp_path: Path) -> None:
    with build_metric_writers(
        LoggerConfig(tensorboard_dir=str(tmp_path)), rank=0, world_size=1
    ) as w:
        with pytest.raises(ValueError, match=r"metric 'grads': got a tensor of shape \(2,\)"):
            w.add_scalar("grads", torch.ones(2), 1)
        with pytest.raises(ValueError, match=r"metric 'name': got 'abc'; expected a number"):
            w.add_scalar("name", "abc", 1)


def test_importing_bridge_logging_loads_no_backend_or_megatron() -> None:
    code = (
        "import sys, bridge.logging\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('wandb', 'mlflow', 'comet_ml', 'tensorboard', 'megatron', 'pynvml'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=180)
