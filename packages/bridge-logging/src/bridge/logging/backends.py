"""One :class:`MetricWriter` per backend: TensorBoard, Weights & Biases, MLflow, Comet.

Each backend package is imported only when its writer is built; a missing package raises
:class:`BackendNotInstalledError` naming the extra to install. Every writer turns values
into Python floats (0-d and one-element tensors included) before handing them over.

This module does not import torch (``to_scalar`` recognises tensors only once torch is
loaded), so the metric writer process, which runs the W&B, MLflow and Comet writers, starts
without it.
"""

from __future__ import annotations

import abc
import importlib
import importlib.util
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from bridge.config import flatten_config
from bridge.logging._notices import notice_once

__all__ = [
    "MLFLOW_NO_URI",
    "BackendNotInstalledError",
    "CometWriter",
    "MetricWriter",
    "MlflowWriter",
    "TensorBoardEventWriter",
    "TensorBoardWriter",
    "WandbWriter",
    "check_table",
    "install_command",
    "is_tensor",
    "mlflow_metric_name",
    "mlflow_tracking_uri",
    "require_backend",
    "to_scalar",
]

# backend kind -> (module to import, extra that installs it)
BACKEND_PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "comet": ("comet_ml", "comet"),
}


class BackendNotInstalledError(ImportError):
    """A configured logging backend's package is not installed."""


def install_command(extra: str) -> str:
    """How to install bridge-logging's ``extra``: with pip, and in a clone of this repository.

    ``uv sync`` removes what it is not asked for, so the workspace spelling keeps the
    packages already installed (``--inexact``).
    """
    return (
        f"`pip install bridge-logging[{extra}]` (in a clone of this repository: "
        f"`uv sync --inexact --extra {extra}`)"
    )


def backend_installed(kind: str) -> bool:
    """Whether the package behind backend ``kind`` can be imported (without importing it)."""
    module, _ = BACKEND_PACKAGES[kind]
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: sys.modules[module] is None
        return False


def require_backend(kind: str, reason: str) -> None:
    """Raise :class:`BackendNotInstalledError` unless backend ``kind`` is installed.

    Args:
        kind: ``"tensorboard"``, ``"wandb"``, ``"mlflow"`` or ``"comet"``.
        reason: The setting that turned the backend on (quoted in the message).
    """
    if not backend_installed(kind):
        module, extra = BACKEND_PACKAGES[kind]
        raise BackendNotInstalledError(
            f"{reason} turns on {kind} logging, but the {module!r} package is not installed; "
            f"install it with {install_command(extra)} or unset {reason}"
        )


def _import_backend(kind: str) -> Any:
    module, extra = BACKEND_PACKAGES[kind]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise BackendNotInstalledError(
            f"{kind} logging needs the {module!r} package, which failed to import ({exc}); "
            f"install it with {install_command(extra)}"
        ) from exc


def _tensor_type() -> type | None:
    """``torch.Tensor`` once torch is imported (a value cannot be a tensor before that)."""
    torch = sys.modules.get("torch")
    return getattr(torch, "Tensor", None) if torch is not None else None


def is_tensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.Tensor`` (without importing torch)."""
    tensor = _tensor_type()
    return tensor is not None and isinstance(value, tensor)


def to_scalar(tag: str, value: Any) -> float:
    """``value`` as a Python float (tensors with one element included).

    Raises:
        ValueError: ``value`` is a tensor with more than one element or not a number.
    """
    if type(value) is float:  # the common case, first
        return value
    if is_tensor(value):
        if value.numel() != 1:
            raise ValueError(
                f"metric {tag!r}: got a tensor of shape {tuple(value.shape)}; "
                "log a single number (reduce it first, e.g. .mean())"
            )
        return float(value.detach().reshape(()).item())
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"metric {tag!r}: got {value!r}; expected a number") from None


_MLFLOW_BAD_CHARS = re.compile(r"[^\w.\- ]")


def mlflow_metric_name(tag: str) -> str:
    """``tag`` made safe for MLflow: letters, digits, ``_ - .`` and spaces are kept.

    Everything else becomes ``_``, slashes included: MLflow's file store keeps one file
    per metric under a path made from the name, so ``throughput/tflops`` (a file) and
    ``throughput/tflops/device`` (a file inside it) cannot both exist.
    """
    return _MLFLOW_BAD_CHARS.sub("_", tag) or "_"


def check_table(
    tag: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]
) -> tuple[tuple[str, ...], tuple[tuple[str, ...], ...]]:
    """``columns`` and ``rows`` as strings, checked: every row has one cell per column.

    Raises:
        ValueError: No columns, or a row of another length; the message names ``tag``.
    """
    header = tuple(str(c) for c in columns)
    if not header:
        raise ValueError(f"table {tag!r}: give at least one column")
    body = tuple(tuple(str(cell) for cell in row) for row in rows)
    for number, row in enumerate(body, start=1):
        if len(row) != len(header):
            raise ValueError(
                f"table {tag!r}: row {number} has {len(row)} cells for {len(header)} columns"
            )
    return header, body


def _markdown_cell(text: str) -> str:
    # A pipe would end the cell and a line break the row; markdown shows <br> as a break.
    return (
        text.replace("\\", "\\\\").replace("|", "\\|").replace("\r\n", "\n").replace("\n", "<br>")
    )


def table_markdown(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table (what TensorBoard's text dashboard renders as a table)."""
    lines = [
        "| " + " | ".join(_markdown_cell(c) for c in columns) + " |",
        "|" + "---|" * len(columns),
    ]
    lines += ["| " + " | ".join(_markdown_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def table_file_name(tag: str, step: int) -> str:
    """Where a table logged under ``tag`` at ``step`` is stored as a file (artifacts)."""
    return f"{mlflow_metric_name(tag)}/step_{int(step):09d}.json"


def _tensorboard_text_summary(tag: str, text: str) -> Any:
    """A TensorBoard text-plugin summary (what ``SummaryWriter.add_text`` writes)."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData

    plugin = SummaryMetadata.PluginData(
        plugin_name="text", content=TextPluginData(version=0).SerializeToString()
    )
    tensor = TensorProto(
        dtype="DT_STRING",
        string_val=[text.encode("utf-8")],
        tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]),
    )
    return Summary(
        value=[
            Summary.Value(
                tag=f"{tag}/text_summary",
                metadata=SummaryMetadata(plugin_data=plugin),
                tensor=tensor,
            )
        ]
    )


class MetricWriter(abc.ABC):
    """The writer interface: scalars by tag and step, flushed and closed explicitly.

    Subclass it to add a backend; :class:`bridge.logging.MetricWriters` fans out to any
    number of them. ``step`` is the training iteration and must not decrease (Weights &
    Biases drops steps that go back).
    """

    kind: ClassVar[str] = "custom"
    """Backend name; :class:`MetricWriters` exposes the backend object of the built-in
    kinds (tensorboard, wandb, mlflow, comet) as attributes of that name."""

    @property
    @abc.abstractmethod
    def backend(self) -> Any:
        """The backend's own object (SummaryWriter, wandb Run, mlflow module, Experiment)."""

    @abc.abstractmethod
    def add_scalar(self, tag: str, value: Any, step: int) -> None:
        """Record one scalar ``value`` under ``tag`` at ``step``."""

    forwarded: ClassVar[frozenset[str]] = frozenset()
    """Methods of :attr:`backend` that :meth:`forward` may call (used by the writer
    process to run calls made on the backend proxies, see ``metric_writers_mode``)."""

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record every ``tag: value`` of ``metrics`` at ``step``."""
        for tag, value in metrics.items():
            self.add_scalar(tag, value, step)

    def log_records(self, records: Sequence[tuple[int, Mapping[str, Any]]]) -> None:
        """Record several ``(step, metrics)`` records, oldest first.

        The writer process hands over every record that is waiting at once; backends that
        can store them in one request override this.
        """
        for step, metrics in records:
            self.log_metrics(metrics, step)

    def log_table(
        self, tag: str, columns: Sequence[str], rows: Sequence[Sequence[str]], step: int
    ) -> None:
        """Record a table of text (``rows`` of cells under ``columns``) under ``tag`` at
        ``step``, e.g. sample completions.

        Every built-in backend shows it in its own way (TensorBoard: a markdown table in the
        text dashboard; W&B: a ``wandb.Table``; MLflow: a JSON artifact; Comet: a table
        asset); the base implementation records nothing, so a custom writer without a text
        view needs no change.
        """
        del tag, columns, rows, step  # nothing to show them in

    def forward(self, method: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Call ``backend.<method>(*args, **kwargs)`` for one of :attr:`forwarded`.

        Raises:
            AttributeError: ``method`` is not forwarded by this backend.
        """
        if method not in self.forwarded:
            raise AttributeError(
                f"the {self.kind} writer does not forward {method!r}; "
                f"forwarded: {', '.join(sorted(self.forwarded)) or 'nothing'}"
            )
        getattr(self.backend, method)(*args, **kwargs)

    @property
    def info(self) -> dict[str, Any]:
        """Plain facts about the run (ids, directories), for the training process."""
        return {}

    @abc.abstractmethod
    def flush(self) -> None:
        """Push buffered records to their destination."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flush and release the backend; the writer is unusable afterwards."""


class TensorBoardWriter(MetricWriter):
    """Event files written by ``torch.utils.tensorboard.SummaryWriter``.

    Args:
        log_dir: Directory of the event files (created if missing; existing files are
            kept, new events go to a new file).
        queue_size: Events held in memory before a write forces a flush.
    """

    kind = "tensorboard"

    def __init__(self, log_dir: str | os.PathLike[str], queue_size: int = 1000) -> None:
        _import_backend("tensorboard")
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard import SummaryWriter

        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self._summary_cls = Summary
        self._writer = SummaryWriter(log_dir=str(log_dir), max_queue=queue_size)
        self.log_dir = str(log_dir)

    @property
    def backend(self) -> Any:
        """The ``SummaryWriter``."""
        return self._writer

    @property
    def info(self) -> dict[str, Any]:
        """The event files' ``log_dir``."""
        return {"log_dir": self.log_dir}

    def add_scalar(self, tag: str, value: Any, step: int) -> None:
        """Write one scalar event."""
        self._writer.add_scalar(tag, to_scalar(tag, value), step)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Write all of ``metrics`` as one event holding one value per tag.

        TensorBoard reads it exactly like separate ``add_scalar`` events, but the event
        file is appended to once instead of once per tag (without TensorFlow installed,
        TensorBoard reopens the file for every record). That needs the ``SummaryWriter``'s
        private ``_get_file_writer()``; a torch without it gets one ``add_scalar`` per tag.
        """
        if not metrics:
            return
        file_writer = getattr(self._writer, "_get_file_writer", None)
        if not callable(file_writer):
            for tag, value in metrics.items():
                self._writer.add_scalar(tag, to_scalar(tag, value), step)
            return
        values = [
            self._summary_cls.Value(tag=t, simple_value=to_scalar(t, v)) for t, v in metrics.items()
        ]
        file_writer().add_summary(self._summary_cls(value=values), step)

    def log_table(
        self, tag: str, columns: Sequence[str], rows: Sequence[Sequence[str]], step: int
    ) -> None:
        """Write the table as markdown to the text dashboard (``<tag>/text_summary``)."""
        header, body = check_table(tag, columns, rows)
        self._writer.add_text(tag, table_markdown(header, body), step)

    def flush(self) -> None:
        """Write pending events to disk."""
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()


class TensorBoardEventWriter(MetricWriter):
    """TensorBoard event files written with the ``tensorboard`` package alone (no torch).

    What the metric writer process runs for TensorBoard (``metrics_writer_mode="process"``):
    it starts without torch, and the per-record work of TensorBoard (serialising, a
    checksum computed in Python, appending to the file) leaves the training process. Each
    record becomes one event holding one value per tag, which TensorBoard reads exactly
    like separate ``add_scalar`` events.

    Args:
        log_dir: Directory of the event files (created if missing; existing files are
            kept, new events go to a new file).
        queue_size: Events held in memory before a write forces a flush.
    """

    kind = "tensorboard"

    def __init__(self, log_dir: str | os.PathLike[str], queue_size: int = 1000) -> None:
        _import_backend("tensorboard")
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self._event_cls, self._summary_cls = Event, Summary
        self._writer = EventFileWriter(str(log_dir), max_queue_size=queue_size)
        self.log_dir = str(log_dir)
        self.queue_size = queue_size

    @property
    def backend(self) -> Any:
        """The ``tensorboard`` ``EventFileWriter``."""
        return self._writer

    @property
    def info(self) -> dict[str, Any]:
        """The event files' ``log_dir`` and the ``queue_size``."""
        return {"log_dir": self.log_dir, "queue_size": self.queue_size}

    def add_scalar(self, tag: str, value: Any, step: int) -> None:
        """Write one scalar event."""
        self.log_metrics({tag: value}, step)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Write all of ``metrics`` as one event holding one value per tag."""
        if not metrics:
            return
        values = [
            self._summary_cls.Value(tag=t, simple_value=to_scalar(t, v)) for t, v in metrics.items()
        ]
        event = self._event_cls(
            wall_time=time.time(), step=int(step), summary=self._summary_cls(value=values)
        )
        self._writer.add_event(event)

    def log_table(
        self, tag: str, columns: Sequence[str], rows: Sequence[Sequence[str]], step: int
    ) -> None:
        """Write the table as markdown to the text dashboard (``<tag>/text_summary``)."""
        header, body = check_table(tag, columns, rows)
        summary = _tensorboard_text_summary(tag, table_markdown(header, body))
        self._writer.add_event(
            self._event_cls(wall_time=time.time(), step=int(step), summary=summary)
        )

    def flush(self) -> None:
        """Write pending events to disk."""
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()


class WandbWriter(MetricWriter):
    """A Weights & Biases run (``wandb.init``); honours ``WANDB_MODE=offline``.

    Args:
        project: W&B project.
        name: Run name.
        entity: User or team.
        save_dir: Local directory for W&B files (created if missing; unset: ``WANDB_DIR``
            or the working directory).
        config: Run configuration shown in the W&B UI.

    Raises:
        RuntimeError: ``wandb.init`` failed (typically no API key in online mode); the
            message says how to log in or go offline.
    """

    kind = "wandb"

    def __init__(
        self,
        project: str,
        *,
        name: str | None = None,
        entity: str | None = None,
        save_dir: str | os.PathLike[str] | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        wandb = _import_backend("wandb")
        if save_dir is not None:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
        try:
            self._run = wandb.init(
                project=project,
                entity=entity,
                name=name,
                dir=None if save_dir is None else str(save_dir),
                config=dict(config) if config is not None else None,
            )
        except Exception as exc:
            raise RuntimeError(
                f"wandb.init(project={project!r}) failed: {exc}. Log in with `wandb login` "
                "(or export WANDB_API_KEY), or export WANDB_MODE=offline to write the run "
                "locally and `wandb sync` it later"
            ) from exc

    forwarded = frozenset({"log", "define_metric"})

    @property
    def backend(self) -> Any:
        """The ``wandb`` run (``.log(dict, step)``, what megatron's MoE helpers expect)."""
        return self._run

    @property
    def info(self) -> dict[str, Any]:
        """The run's ``id``, ``name``, ``project`` and local ``dir``."""
        run = self._run
        return {
            "id": run.id,
            "name": run.name,
            "project": run.project,
            "dir": run.dir,
        }

    def add_scalar(self, tag: str, value: Any, step: int) -> None:
        """Log ``{tag: value}`` at ``step``."""
        self._run.log({tag: to_scalar(tag, value)}, step=step)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log all of ``metrics`` in one W&B history row at ``step``."""
        if metrics:
            self._run.log({t: to_scalar(t, v) for t, v in metrics.items()}, step=step)

    def log_table(
        self, tag: str, columns: Sequence[str], rows: Sequence[Sequence[str]], step: int
    ) -> None:
        """Log a ``wandb.Table`` under ``tag`` at ``step``."""
        import wandb

        header, body = check_table(tag, columns, rows)
        table = wandb.Table(columns=list(header), data=[list(row) for row in body])
        self._run.log({tag: table}, step=step)

    def flush(self) -> None:
        """Nothing to do: every ``log`` call is handed to W&B's service process at once."""

    def close(self) -> None:
        """Finish the run (offline runs are then complete on disk)."""
        self._run.finish()


def _mlflow_params(config: Mapping[str, Any], max_length: int) -> dict[str, str]:
    params = {}
    for key, value in flatten_config(config).items():
        text = str(value)
        params[mlflow_metric_name(key)] = (
            text if len(text) <= max_length else text[: max_length - 3] + "..."
        )
    return params


def mlflow_tracking_uri(uri: str | None) -> str | None:
    """The tracking URI MLflow will use: ``uri``, else ``MLFLOW_TRACKING_URI``, else ``None``."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or None


MLFLOW_NO_URI = (
    "MLflow logging is on (LoggerConfig.mlflow_experiment={experiment!r}) but no tracking URI "
    "is set; set LoggerConfig.mlflow_tracking_uri (e.g. bridge-train "
    "logger.mlflow_tracking_uri=http://mlflow-server:5000, or file:./mlruns with "
    "MLFLOW_ALLOW_FILE_STORE=true) or export MLFLOW_TRACKING_URI"
)

# MLflow's limit on the metrics of one log_batch request.
_MLFLOW_BATCH = 1000


class MlflowWriter(MetricWriter):
    """An MLflow run, written through one ``MlflowClient``.

    Every call stores its values before it returns, so the run holds them in the order
    they were logged (MLflow's asynchronous logging stores concurrent batches in any
    order). In the default writer-process mode this happens off the training step.
    Metric and parameter names keep letters, digits, ``_ - .`` and spaces; other
    characters, ``/`` included, become ``_``.

    The run: ``run_id`` if given (left running on close); else the run already active in
    this process (left running); else a new run in ``experiment``, started with MLflow's
    fluent API (so ``mlflow.log_*`` calls of other code reach it too) and ended on close.

    Args:
        experiment: Experiment name (created if missing).
        tracking_uri: Tracking URI, or ``None`` for ``MLFLOW_TRACKING_URI``.
        run_name: Run name of a new run.
        config: Run configuration, logged as parameters (flattened to dotted keys).
        tags: Tags set on the run.
        run_id: Log into this existing run.

    Raises:
        ValueError: No tracking URI is set.
        RuntimeError: MLflow refused the URI or the experiment (e.g. a ``file:`` store
            without ``MLFLOW_ALLOW_FILE_STORE=true`` under MLflow 3).
    """

    kind = "mlflow"
    forwarded = frozenset(
        {"log_metric", "log_metrics", "log_param", "log_params", "set_tag", "set_tags"}
    )

    def __init__(
        self,
        experiment: str,
        *,
        tracking_uri: str | None = None,
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        tags: Mapping[str, str] | None = None,
        run_id: str | None = None,
    ) -> None:
        uri = mlflow_tracking_uri(tracking_uri)
        if not uri:
            raise ValueError(MLFLOW_NO_URI.format(experiment=experiment))
        mlflow = _import_backend("mlflow")
        self._mlflow = mlflow
        try:
            from mlflow.entities import Metric, Param, RunTag
            from mlflow.tracking import MlflowClient

            mlflow.set_tracking_uri(uri)
            self._client = MlflowClient(tracking_uri=uri)
            self._owns_run = False
            if run_id is None:
                active = mlflow.active_run()
                if active is None:
                    mlflow.set_experiment(experiment)
                    active = mlflow.start_run(run_name=run_name)
                    self._owns_run = True
                run_id = active.info.run_id
            else:
                self._client.get_run(run_id)  # fails early on an unknown run
            self.run_id: str = run_id
            params = [
                Param(k, v) for k, v in _mlflow_params(config or {}, _mlflow_param_limit()).items()
            ]
            run_tags = [RunTag(str(k), str(v)) for k, v in (tags or {}).items()]
            for i in range(0, max(len(params), len(run_tags)), 100):  # MLflow's batch limits
                self._client.log_batch(
                    run_id, params=params[i : i + 100], tags=run_tags[i : i + 100]
                )
        except Exception as exc:
            raise RuntimeError(
                f"MLflow could not start a run in experiment {experiment!r} at tracking URI "
                f"{uri!r}: {exc}"
            ) from exc
        self.tracking_uri = uri
        self._metric_cls = Metric
        self._ended = False

    @property
    def backend(self) -> Any:
        """The ``mlflow`` module (its active run is this writer's when it started it)."""
        return self._mlflow

    @property
    def info(self) -> dict[str, Any]:
        """The ``run_id`` and the ``tracking_uri``."""
        return {"run_id": self.run_id, "tracking_uri": self.tracking_uri}

    def add_scalar(self, tag: str, value: Any, step: int) -> None:
        """Store one metric value at ``step``."""
        self.log_metrics({tag: value}, step)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Store all of ``metrics`` at ``step`` in one request."""
        self.log_records([(step, metrics)])

    def log_records(self, records: Sequence[tuple[int, Mapping[str, Any]]]) -> None:
        """Store several steps' metrics in as few requests as MLflow allows."""
        timestamp = int(time.time() * 1000)
        batch = [
            self._metric_cls(mlflow_metric_name(t), to_scalar(t, v), timestamp, step)
            for step, metrics in records
            for t, v in metrics.items()
        ]
        for i in range(0, len(batch), _MLFLOW_BATCH):
            self._client.log_batch(self.run_id, metrics=batch[i : i + _MLFLOW_BATCH])

    def log_table(
        self, tag: str, columns: Sequence[str], rows: Sequence[Sequence[str]], step: int
    ) -> None:
        """Store the table as the run artifact ``<tag>/step_<step>.json``
        (``{"columns": [...], "data": [[...], ...], "step": step}``)."""
        import json

        header, body = check_table(tag, columns, rows)
        text = json.dumps(
            {"columns": list(header), "data": [list(r) for r in body], "step": int(step)},
            ensure_ascii=False,
            indent=1,
        )
        self._client.log_text(self.run_id, text, table_file_name(tag, step))

    def forward(self, method: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Run ``mlflow.<method>(...)`` (log_metric(s), log_param(s), set_tag(s)) on this run.

        Calls go to this writer's run through the client, like the fluent API would for
        the active run, so they also work when the run is not active in this process.
        """
        if method not in self.forwarded:
            super().forward(method, args, kwargs)
        call = dict(zip(_MLFLOW_SIGNATURES[method], args, strict=False), **kwargs)
        client, run = self._client, self.run_id
        if method == "log_metric":
            client.log_metric(
                run,
                call["key"],
                float(call["value"]),
                timestamp=call.get("timestamp"),
                step=call.get("step"),
            )
        elif method == "log_metrics":
            timestamp = call.get("timestamp") or int(time.time() * 1000)
            step = call.get("step") or 0
            metrics = [
                self._metric_cls(k, float(v), timestamp, step) for k, v in call["metrics"].items()
            ]
            client.log_batch(run, metrics=metrics)
        elif method == "log_param":
            client.log_param(run, call["key"], call["value"])
        elif method == "log_params":
            for key, value in call["params"].items():
                client.log_param(run, key, value)
        elif method == "set_tag":
            client.set_tag(run, call["key"], call["value"])
        else:  # set_tags
            for key, value in call["tags"].items():
                client.set_tag(run, key, value)

    def flush(self) -> None:
        """Nothing to do: every call stores its values before it returns."""

    def close(self) -> None:
        """End the run if this writer started it (idempotent)."""
        if self._ended:
            return
        self._ended = True
        if self._owns_run and self._mlflow.active_run() is not None:
            self._mlflow.end_run()


# Positional parameter names of the forwarded fluent functions (mlflow.log_metric, ...).
_MLFLOW_SIGNATURES: dict[str, tuple[str, ...]] = {
    "log_metric": ("key", "value", "step", "synchronous", "timestamp"),
    "log_metrics": ("metrics", "step", "synchronous", "run_id", "timestamp"),
    "log_param": ("key", "value"),
    "log_params": ("params",),
    "set_tag": ("key", "value"),
    "set_tags": ("tags",),
}


def _mlflow_param_limit() -> int:
    try:
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH
    except ImportError:  # moved in a future MLflow: its documented limit
        return 6000
    return int(MAX_PARAM_VAL_LENGTH)


def _comet_api_key(comet_ml: Any) -> str | None:
    try:
        key = comet_ml.get_config()["comet.api_key"]
    except (KeyError, AttributeError):
        return None
    return key or None


class CometWriter(MetricWriter):
    """A Comet experiment, online (``comet_ml.Experiment``) or offline (a zip archive).

    Args:
        project: Comet project.
        workspace: Comet workspace.
        name: Experiment name.
        mode: ``"online"``, ``"offline"`` or ``"auto"`` (see
            ``LoggerConfig.comet_mode``).
        offline_dir: Directory of offline archives.
        config: Run configuration, logged as parameters.
        tags: Tags added to the experiment.

    Raises:
        ValueError: ``mode="online"`` (or ``COMET_MODE=online``) without an API key.
    """

    kind = "comet"
    forwarded = frozenset(
        {
            "log_metric",
            "log_metrics",
            "log_parameter",
            "log_parameters",
            "log_other",
            "log_others",
            "add_tag",
            "add_tags",
            "set_name",
        }
    )

    def __init__(
        self,
        project: str,
        *,
        workspace: str | None = None,
        name: str | None = None,
        mode: str = "auto",
        offline_dir: str | os.PathLike[str] | None = None,
        config: Mapping[str, Any] | None = None,
        tags: Sequence[str] | None = None,
    ) -> None:
        comet_ml = _import_backend("comet")
        api_key = _comet_api_key(comet_ml)
        env_mode = os.environ.get("COMET_MODE", "").strip().lower()
        if mode == "auto":
            mode = env_mode if env_mode in ("online", "offline") else "auto"
        if mode == "online" and api_key is None:
            raise ValueError(
                f"Comet online mode for project {project!r} needs an API key; export "
                "COMET_API_KEY (or run `comet login`), or set LoggerConfig.comet_mode="
                "'offline' to write an archive to upload later"
            )
        self.offline = mode == "offline" or api_key is None
        # Training code owns stdout and the metrics: turn off Comet's own capture and
        # auto-logging so every value in the experiment comes from these writers.
        quiet = {
            "log_code": False,
            "log_graph": False,
            "auto_param_logging": False,
            "auto_metric_logging": False,
            "parse_args": False,
            "auto_output_logging": None,
            "log_git_metadata": False,
            "log_git_patch": False,
            "display_summary_level": 0,
        }
        if self.offline:
            if offline_dir is not None:
                Path(offline_dir).mkdir(parents=True, exist_ok=True)
            self._experiment = comet_ml.OfflineExperiment(
                project_name=project,
                workspace=workspace,
                offline_directory=None if offline_dir is None else str(offline_dir),
                **quiet,
            )
            where = offline_dir or os.environ.get("COMET_OFFLINE_DIRECTORY", ".cometml-runs")
            notice_once(
                f"comet-offline-{where}",
                f"Comet is logging offline (no API key or COMET_MODE=offline): the archive "
                f"goes to {where}; upload it with `comet upload <archive>.zip`",
            )
        else:
            self._experiment = comet_ml.Experiment(
                api_key=api_key, project_name=project, workspace=workspace, **quiet
            )
        if name:
            self._experiment.set_name(name)
        if config:
            self._experiment.log_parameters(flatten_config(config))
        if tags:
            self._experiment.add_tags(list(tags))
        self._ended = False

    @property
    def backend(self) -> Any:
        """The Comet ``Experiment`` (or ``OfflineExperiment``)."""
        return self._experiment

    @property
    def info(self) -> dict[str, Any]:
        """Whether the experiment is ``offline``, and its ``id``."""
        return {"offline": self.offline, "id": self._experiment.get_key()}

    def add_scalar(self, tag: str, value: Any, step: int) -> None:
        """Log one metric value at ``step``."""
        self._experiment.log_metric(tag, to_scalar(tag, value), step=step)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log all of ``metrics`` at ``step``."""
        if metrics:
            self._experiment.log_metrics(
                {t: to_scalar(t, v) for t, v in metrics.items()}, step=step
            )

    def log_table(
        self, tag: str, columns: Sequence[str], rows: Sequence[Sequence[str]], step: int
    ) -> None:
        """Log the table as the CSV asset ``<tag>/step_<step>.csv``."""
        header, body = check_table(tag, columns, rows)
        name = table_file_name(tag, step).removesuffix(".json") + ".csv"
        self._experiment.log_table(name, tabular_data=[list(r) for r in body], headers=list(header))

    def flush(self) -> None:
        """Send (or, offline, write) the queued messages."""
        if not self._ended:
            self._experiment.flush()

    def close(self) -> None:
        """End the experiment; offline, this writes the zip archive."""
        if not self._ended:
            self._ended = True
            self._experiment.end()
