"""One :class:`MetricWriter` per backend: TensorBoard, Weights & Biases, MLflow, Comet.

Each backend package is imported only when its writer is built; a missing package raises
:class:`BackendNotInstalledError` naming the extra to install. Every writer turns values
into Python floats (0-d and one-element tensors included) before handing them over.
"""

from __future__ import annotations

import abc
import importlib
import importlib.util
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from bridge.logging._dist import notice_once

# backend kind -> (module to import, extra that installs it)
BACKEND_PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "comet": ("comet_ml", "comet"),
}


class BackendNotInstalledError(ImportError):
    """A configured logging backend's package is not installed."""


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
            f"install it with `pip install bridge-logging[{extra}]` or unset {reason}"
        )


def _import_backend(kind: str) -> Any:
    module, extra = BACKEND_PACKAGES[kind]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise BackendNotInstalledError(
            f"{kind} logging needs the {module!r} package, which failed to import ({exc}); "
            f"install it with `pip install bridge-logging[{extra}]`"
        ) from exc


def to_scalar(tag: str, value: Any) -> float:
    """``value`` as a Python float (tensors with one element included).

    Raises:
        ValueError: ``value`` is a tensor with more than one element or not a number.
    """
    if isinstance(value, torch.Tensor):
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


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings flattened to dotted keys (``{"train": {"lr": 1}}`` -> ``train.lr``)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten_config(value, name))
        else:
            flat[name] = value
    return flat


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

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record every ``tag: value`` of ``metrics`` at ``step``."""
        for tag, value in metrics.items():
            self.add_scalar(tag, value, step)

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

    def add_scalar(self, tag: str, value: Any, step: int) -> None:
        """Write one scalar event."""
        self._writer.add_scalar(tag, to_scalar(tag, value), step)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Write all of ``metrics`` as one event holding one value per tag.

        TensorBoard reads it exactly like separate ``add_scalar`` events, but the event
        file is appended to once instead of once per tag (without TensorFlow installed,
        TensorBoard reopens the file for every record).
        """
        if not metrics:
            return
        values = [
            self._summary_cls.Value(tag=t, simple_value=to_scalar(t, v)) for t, v in metrics.items()
        ]
        self._writer._get_file_writer().add_summary(self._summary_cls(value=values), step)

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

    @property
    def backend(self) -> Any:
        """The ``wandb`` run (``.log(dict, step)``, what megatron's MoE helpers expect)."""
        return self._run

    def add_scalar(self, tag: str, value: Any, step: int) -> None:
        """Log ``{tag: value}`` at ``step``."""
        self._run.log({tag: to_scalar(tag, value)}, step=step)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log all of ``metrics`` in one W&B history row at ``step``."""
        if metrics:
            self._run.log({t: to_scalar(t, v) for t, v in metrics.items()}, step=step)

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


class MlflowWriter(MetricWriter):
    """An MLflow run: started with MLflow's fluent API, so ``mlflow.log_*`` calls of other
    code (the MoE fan-out, a user's callbacks) reach it too.

    This writer's metrics go through one ``MlflowClient`` with MLflow's asynchronous
    logging (a background queue, kept in order), so a training step does not wait for
    the tracking store; :meth:`flush` and :meth:`close` wait for the queue. Metric and parameter names keep letters, digits, ``_ - .`` and
    spaces; other characters, ``/`` included, become ``_``.

    If a run is already active in this process, metrics go to it and it is left running
    on close; otherwise a run is started in ``experiment`` and ended on close.

    Args:
        experiment: Experiment name (created if missing).
        tracking_uri: Tracking URI, or ``None`` for ``MLFLOW_TRACKING_URI``.
        run_name: Run name.
        config: Run configuration, logged as parameters (flattened to dotted keys).

    Raises:
        ValueError: No tracking URI is set.
        RuntimeError: MLflow refused the URI or the experiment (e.g. a ``file:`` store
            without ``MLFLOW_ALLOW_FILE_STORE=true`` under MLflow 3).
    """

    kind = "mlflow"

    def __init__(
        self,
        experiment: str,
        *,
        tracking_uri: str | None = None,
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            raise ValueError(
                "MLflow logging is on (BackendSettings.mlflow_experiment="
                f"{experiment!r}) but no tracking URI is set; set "
                "BackendSettings.mlflow_tracking_uri or export MLFLOW_TRACKING_URI "
                "(e.g. http://mlflow-server:5000, or file:/path/to/mlruns with "
                "MLFLOW_ALLOW_FILE_STORE=true)"
            )
        mlflow = _import_backend("mlflow")
        self._mlflow = mlflow
        try:
            mlflow.set_tracking_uri(uri)
            active = mlflow.active_run()
            self._owns_run = active is None
            if active is None:
                mlflow.set_experiment(experiment)
                active = mlflow.start_run(run_name=run_name)
            self.run_id: str = active.info.run_id
            if config:
                from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

                mlflow.log_params(_mlflow_params(config, MAX_PARAM_VAL_LENGTH))
        except Exception as exc:
            raise RuntimeError(
                f"MLflow could not start a run in experiment {experiment!r} at tracking URI "
                f"{uri!r}: {exc}"
            ) from exc
        self.tracking_uri = uri
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        self._metric_cls = Metric
        self._client = MlflowClient(tracking_uri=uri)

    @property
    def backend(self) -> Any:
        """The ``mlflow`` module, with this writer's run active."""
        return self._mlflow

    def add_scalar(self, tag: str, value: Any, step: int) -> None:
        """Log one metric value at ``step``."""
        self.log_metrics({tag: value}, step)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Queue all of ``metrics`` at ``step`` as one batch."""
        if not metrics:
            return
        timestamp = int(time.time() * 1000)
        batch = [
            self._metric_cls(mlflow_metric_name(t), to_scalar(t, v), timestamp, step)
            for t, v in metrics.items()
        ]
        # One client for the run: the fluent API builds a client (and resolves the
        # registry URI) on every call, which costs milliseconds per step.
        self._client.log_batch(self.run_id, metrics=batch, synchronous=False)

    def flush(self) -> None:
        """Wait until every queued metric is stored."""
        self._mlflow.flush_async_logging()

    def close(self) -> None:
        """Store the queued metrics and end the run if this writer started it."""
        self.flush()
        if self._owns_run and self._mlflow.active_run() is not None:
            self._mlflow.end_run()


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
            :attr:`bridge.logging.BackendSettings.comet_mode`).
        offline_dir: Directory of offline archives.
        config: Run configuration, logged as parameters.

    Raises:
        ValueError: ``mode="online"`` (or ``COMET_MODE=online``) without an API key.
    """

    kind = "comet"

    def __init__(
        self,
        project: str,
        *,
        workspace: str | None = None,
        name: str | None = None,
        mode: str = "auto",
        offline_dir: str | os.PathLike[str] | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        comet_ml = _import_backend("comet")
        api_key = _comet_api_key(comet_ml)
        env_mode = os.environ.get("COMET_MODE", "").strip().lower()
        if mode == "auto":
            mode = env_mode if env_mode in ("online", "offline") else "auto"
        if mode == "online" and api_key is None:
            raise ValueError(
                f"Comet online mode for project {project!r} needs an API key; export "
                "COMET_API_KEY (or run `comet login`), or use BackendSettings.comet_mode="
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
        self._ended = False

    @property
    def backend(self) -> Any:
        """The Comet ``Experiment`` (or ``OfflineExperiment``)."""
        return self._experiment

    def add_scalar(self, tag: str, value: Any, step: int) -> None:
        """Log one metric value at ``step``."""
        self._experiment.log_metric(tag, to_scalar(tag, value), step=step)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log all of ``metrics`` at ``step``."""
        if metrics:
            self._experiment.log_metrics(
                {t: to_scalar(t, v) for t, v in metrics.items()}, step=step
            )

    def flush(self) -> None:
        """Send (or, offline, write) the queued messages."""
        if not self._ended:
            self._experiment.flush()

    def close(self) -> None:
        """End the experiment; offline, this writes the zip archive."""
        if not self._ended:
            self._ended = True
            self._experiment.end()
