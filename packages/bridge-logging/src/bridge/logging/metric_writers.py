"""``MetricWriters``: the fan-out over every configured backend, and how it is built."""

from __future__ import annotations

import logging
import sys
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import torch.distributed as dist

from bridge.config import LoggerConfig
from bridge.logging._batches import BatchHistory
from bridge.logging._remote import RemoteWriter, remote_writers
from bridge.logging._worker import WriterThread
from bridge.logging._writer_process import WriterProcess
from bridge.logging.backends import (
    MLFLOW_NO_URI,
    CometWriter,
    MetricWriter,
    MlflowWriter,
    TensorBoardWriter,
    WandbWriter,
    check_table,
    mlflow_tracking_uri,
    require_backend,
    to_scalar,
)
from bridge.logging.settings import (
    REPORT_SOURCE_FIELDS,
    BackendSettings,
    ReportSettings,
    backend_settings_for,
    report_settings_for,
)
from core_utils.distributed import any_rank, dist_ready

__all__ = ["MetricWriters", "build_metric_writers", "tensorboard_only"]

logger = logging.getLogger("bridge.logging")


@dataclass
class _IntervalMarks:
    """What ``training_log`` remembers between calls (one instance per run)."""

    previous_flops: float | None = None
    known_flops: float = 0.0
    known_iterations: int = 0
    energy_monitor: Any = None
    energy_unavailable: bool = False
    batches: BatchHistory = field(default_factory=BatchHistory)


class MetricWriters:
    """Every configured metric backend behind one ``add_scalar`` / ``log_metrics``.

    Built by :func:`build_metric_writers` on every rank; only the last rank holds
    backends, elsewhere it is empty (``enabled`` is false and writes do nothing), so
    code can call it unconditionally.

    Writers of a metric writer process (:class:`bridge.logging._remote.RemoteWriter`, see
    ``LoggerConfig.metrics_writer_mode``) that share a process receive one record per
    call, not one per backend.

    With ``asynchronous=True`` the writers' calls run in order on one background thread,
    so a training step only pays for turning values into floats. It helps where the
    training thread mostly waits (on the GPU); in CPU training the thread competes for
    the GIL, which is why the default writer-process mode exists. Values are converted (and
    bad ones rejected) in the caller; a backend error surfaces as ``RuntimeError`` at the
    next call. Reading a backend attribute (``.tensorboard``, ``.wandb``, ``.mlflow``,
    ``.comet``) first waits for the queued calls, so code that then writes to the backend
    directly (megatron's MoE helpers) stays in step order.

    Args:
        writers: The backends to fan out to.
        report_settings: Overrides of the ``LoggerConfig`` report fields for
            :func:`bridge.logging.training_log` (see :class:`ReportSettings`).
        asynchronous: Run the writers' calls on a background thread.
    """

    def __init__(
        self,
        writers: Sequence[MetricWriter] = (),
        *,
        report_settings: ReportSettings | None = None,
        asynchronous: bool = False,
    ) -> None:
        for writer in writers:
            if not isinstance(writer, MetricWriter):
                raise TypeError(
                    f"writers must be MetricWriter instances, got {type(writer).__name__}; "
                    "subclass bridge.logging.MetricWriter to add a backend"
                )
        if report_settings is not None and not isinstance(report_settings, ReportSettings):
            raise TypeError(
                f"report_settings must be a ReportSettings, got {type(report_settings).__name__}"
            )
        self._writers: tuple[MetricWriter, ...] = tuple(writers)
        self._local = tuple(w for w in self._writers if not isinstance(w, RemoteWriter))
        # One entry per writer process: the kinds of its writers that are listed here.
        processes: dict[WriterProcess, list[str]] = {}
        for writer in self._writers:
            if isinstance(writer, RemoteWriter):
                processes.setdefault(writer.process, []).append(writer.kind)
        self._processes = tuple((p, tuple(kinds)) for p, kinds in processes.items())
        self._closed = False
        self._worker = WriterThread() if asynchronous and self._writers else None
        self._report_settings = report_settings
        self._reports: tuple[tuple[int, list[Any]], ReportSettings] | None = None
        self.marks = _IntervalMarks()

    def _run(self, fn: Any, *args: Any) -> None:
        if self._worker is not None:
            self._worker.submit(fn, *args)
        else:
            fn(*args)

    def _backend(self, kind: str) -> Any:
        for writer in self._writers:
            if writer.kind == kind:
                if self._worker is not None and not self._closed:
                    self._worker.drain()
                return writer.backend
        return None

    @property
    def writers(self) -> tuple[MetricWriter, ...]:
        """The backends, in the order they are written to."""
        return self._writers

    @property
    def report_settings(self) -> ReportSettings:
        """The report settings given when built (all defaults when none were)."""
        return self._report_settings or ReportSettings()

    def reports_for(self, logger_cfg: LoggerConfig) -> ReportSettings:
        """The reports :func:`bridge.logging.training_log` writes for ``logger_cfg``.

        The ``LoggerConfig`` report fields, overridden by the fields set in the
        ``report_settings`` these writers were built with.
        """
        # Called every step: merge again only when the fields it reads have changed.
        key = (id(logger_cfg), [getattr(logger_cfg, name) for name in REPORT_SOURCE_FIELDS])
        if self._reports is None or self._reports[0] != key:
            self._reports = (key, report_settings_for(logger_cfg, self._report_settings))
        return self._reports[1]

    @property
    def asynchronous(self) -> bool:
        """Whether backend calls run on a background thread."""
        return self._worker is not None

    @property
    def writer_process_pids(self) -> tuple[int, ...]:
        """Process ids of the metric writer processes the writers write through."""
        return tuple(process.pid for process, _ in self._processes)

    @property
    def tensorboard(self) -> Any:
        """The TensorBoard ``SummaryWriter``, or ``None``."""
        return self._backend("tensorboard")

    @property
    def wandb(self) -> Any:
        """The W&B run (in process mode a proxy with ``log`` / ``define_metric``), or ``None``."""
        return self._backend("wandb")

    @property
    def mlflow(self) -> Any:
        """The ``mlflow`` module with the run active (in process mode a proxy with
        ``log_metric(s)``, ``log_param(s)``, ``set_tag(s)``), or ``None``."""
        return self._backend("mlflow")

    @property
    def comet(self) -> Any:
        """The Comet experiment (in process mode a proxy with ``log_metric(s)``,
        ``log_parameter(s)``, ``log_other(s)``, ``add_tag(s)``, ``set_name``), or ``None``."""
        return self._backend("comet")

    @property
    def enabled(self) -> bool:
        """Whether any backend is configured on this rank (and the writers are open)."""
        return bool(self._writers) and not self._closed

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("MetricWriters is closed; build new writers to log more")

    def add_scalar(self, tag: str, value: Any, step: int) -> None:
        """Record ``value`` under ``tag`` at iteration ``step`` in every backend.

        Raises:
            RuntimeError: The writers are closed, a backend failed in the background, or
                the metric writer process died.
            ValueError: ``value`` is not a single number.
        """
        self.log_metrics({tag: value}, step)

    def log_metrics(
        self, metrics: Mapping[str, Any], step: int, *, only: Collection[str] | None = None
    ) -> None:
        """Record every ``tag: value`` of ``metrics`` at iteration ``step``.

        Args:
            metrics: Tag -> number (Python number or one-element tensor).
            step: The iteration (W&B needs it never to decrease).
            only: Backend kinds to write to (e.g. ``{"tensorboard"}`` for series whose
                step is not the iteration); default: every backend.

        Raises:
            RuntimeError: The writers are closed, a backend failed in the background, or
                the metric writer process died.
            ValueError: A value is not a single number.
        """
        self.log_many([(metrics, step, only)])

    def log_many(
        self, records: Sequence[tuple[Mapping[str, Any], int, Collection[str] | None]]
    ) -> None:
        """Record several ``(metrics, step, only)`` at once, in order (see :meth:`log_metrics`).

        A metric writer process receives them in one message, so logging a step's metrics
        and their TensorBoard-only ``vs samples`` twins costs one pipe write.

        Raises:
            RuntimeError: As :meth:`log_metrics`.
            ValueError: A value is not a single number.
        """
        self._check_open()
        if not self._writers:
            return
        converted = [
            ({tag: to_scalar(tag, value) for tag, value in metrics.items()}, step, only)
            for metrics, step, only in records
            if metrics
        ]
        if not converted:
            return
        for writer in self._local:
            for values, step, only in converted:
                if only is None or writer.kind in only:
                    self._run(writer.log_metrics, values, step)
        for process, kinds in self._processes:
            batch = []
            for values, step, only in converted:
                chosen = kinds if only is None else tuple(k for k in kinds if k in only)
                if chosen:
                    # None: every writer of the process (the common case, a smaller record).
                    batch.append((values, step, None if chosen == process.kinds else chosen))
            if batch:
                self._run(process.send_records, batch)

    def log_table(
        self,
        tag: str,
        columns: Sequence[str],
        rows: Sequence[Sequence[Any]],
        step: int,
        *,
        only: Collection[str] | None = None,
    ) -> None:
        """Record a table of text under ``tag`` at iteration ``step`` in every backend
        (TensorBoard text, W&B table, MLflow and Comet artifacts; see
        :meth:`bridge.logging.MetricWriter.log_table`), in order with the metrics.

        Args:
            tag: Name of the table (e.g. ``"samples"``).
            columns: Column names.
            rows: One sequence of cells per row (turned into strings).
            step: The iteration.
            only: Backend kinds to write to (default: every backend).

        Raises:
            RuntimeError: As :meth:`log_metrics`.
            ValueError: No columns, or a row with another number of cells.
        """
        self._check_open()
        header, body = check_table(tag, columns, rows)
        if not self._writers:
            return
        for writer in self._local:
            if only is None or writer.kind in only:
                self._run(writer.log_table, tag, header, body, step)
        for process, kinds in self._processes:
            chosen = kinds if only is None else tuple(k for k in kinds if k in only)
            if chosen:
                selected = None if chosen == process.kinds else chosen
                self._run(process.send_table, selected, tag, header, body, step)

    def flush(self) -> None:
        """Flush every backend and wait for it (a no-op once closed).

        In process mode this waits until the writer process has written everything
        recorded so far.

        Raises:
            RuntimeError: A backend failed in the background, or the metric writer
                process died.
        """
        if self._closed:
            return
        for writer in self._local:
            self._run(writer.flush)
        for process, _ in self._processes:
            self._run(process.flush)
        for writer in self._writers:
            if isinstance(writer, RemoteWriter):
                self._run(writer.flush_local)
        if self._worker is not None:
            self._worker.drain()

    def close(self) -> None:
        """Write what is queued and close every backend. Idempotent and never raises.

        A backend that fails (now or earlier in the background) is logged at ERROR level
        and the others are still closed, so this is safe in a ``finally`` block. A metric
        writer process is closed (drained, its backends closed, joined) once all of its
        writers are; it is also closed at interpreter exit if never closed.
        """
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            self._worker.stop()
            try:
                self._worker.raise_pending()
            except RuntimeError:
                logger.exception("a metric writer failed before close")
        for writer in self._writers:
            try:
                writer.close()
            except Exception:
                logger.exception("closing the %s metric writer failed", writer.kind)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        kinds = ", ".join(w.kind for w in self._writers) or "no backends"
        return f"MetricWriters({kinds}{', closed' if self._closed else ''})"


def tensorboard_only(writers: MetricWriters, metrics: Mapping[str, Any], step: int) -> None:
    """Write ``metrics`` at ``step`` to the TensorBoard writer(s) of ``writers`` only.

    For series whose step is not the iteration (``<tag> vs samples``), which Weights &
    Biases would drop as going backwards.
    """
    if writers.enabled and metrics:
        writers.log_metrics(metrics, step, only=("tensorboard",))


def _check_rank(rank: Any, world_size: Any) -> None:
    for name, value, low in (("world_size", world_size, 1), ("rank", rank, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"build_metric_writers: {name} must be an int >= {low}, got {value!r}")
    if rank >= world_size:
        raise ValueError(
            f"build_metric_writers: rank must be < world_size ({world_size}), got {rank}"
        )


def _plain_config(run_config: Any) -> Mapping[str, Any] | None:
    if run_config is None:
        return None
    if isinstance(run_config, Mapping):
        return run_config
    to_dict = getattr(run_config, "to_dict", None)
    if callable(to_dict):
        result = to_dict()
        if isinstance(result, Mapping):
            return result
    raise TypeError(
        "run_config must be a mapping or an object with to_dict() (such as "
        f"ConfigContainer), got {type(run_config).__name__}"
    )


def _check_backends(logger_cfg: LoggerConfig, settings: BackendSettings) -> None:
    """Fail on every rank, before anything is built, on a missing package or tracking URI."""
    if logger_cfg.tensorboard_dir is not None:
        require_backend("tensorboard", "LoggerConfig.tensorboard_dir")
    if logger_cfg.wandb_project is not None:
        require_backend("wandb", "LoggerConfig.wandb_project")
    if settings.mlflow_experiment is not None:
        require_backend("mlflow", "LoggerConfig.mlflow_experiment")
        if mlflow_tracking_uri(settings.mlflow_tracking_uri) is None:
            raise ValueError(MLFLOW_NO_URI.format(experiment=settings.mlflow_experiment))
    if settings.comet_project is not None:
        require_backend("comet", "LoggerConfig.comet_project")


def _active_mlflow_run_id() -> str | None:
    """The MLflow run active in this process, if MLflow is already imported here."""
    mlflow = sys.modules.get("mlflow")
    active = getattr(mlflow, "active_run", None)
    run = active() if callable(active) else None
    return None if run is None else str(run.info.run_id)


_BACKENDS = "bridge.logging.backends"


def _writer_specs(
    logger_cfg: LoggerConfig,
    settings: BackendSettings,
    config: Mapping[str, Any] | None,
) -> list[tuple[str, str, dict[str, Any]]]:
    """``(kind, factory, kwargs)`` of the W&B, MLflow and Comet writers that are configured."""
    specs: list[tuple[str, str, dict[str, Any]]] = []
    config = None if config is None else dict(config)
    if logger_cfg.wandb_project is not None:
        specs.append(
            (
                "wandb",
                f"{_BACKENDS}:WandbWriter",
                {
                    "project": logger_cfg.wandb_project,
                    "name": logger_cfg.wandb_exp_name,
                    "entity": logger_cfg.wandb_entity,
                    "save_dir": logger_cfg.wandb_save_dir,
                    "config": config,
                },
            )
        )
    if settings.mlflow_experiment is not None:
        specs.append(
            (
                "mlflow",
                f"{_BACKENDS}:MlflowWriter",
                {
                    "experiment": settings.mlflow_experiment,
                    "tracking_uri": settings.mlflow_tracking_uri,
                    "run_name": settings.mlflow_run_name or logger_cfg.wandb_exp_name,
                    "config": config,
                    "tags": settings.mlflow_tags,
                    "run_id": _active_mlflow_run_id(),
                },
            )
        )
    if settings.comet_project is not None:
        specs.append(
            (
                "comet",
                f"{_BACKENDS}:CometWriter",
                {
                    "project": settings.comet_project,
                    "workspace": settings.comet_workspace,
                    "name": settings.comet_experiment_name or logger_cfg.wandb_exp_name,
                    "mode": settings.comet_mode,
                    "offline_dir": settings.comet_offline_dir,
                    "config": config,
                    "tags": settings.comet_tags,
                },
            )
        )
    return specs


_INLINE: dict[str, type[MetricWriter]] = {
    "wandb": WandbWriter,
    "mlflow": MlflowWriter,
    "comet": CometWriter,
}


def _build_backends(
    logger_cfg: LoggerConfig, settings: BackendSettings, config: Mapping[str, Any] | None
) -> list[MetricWriter]:
    writers: list[MetricWriter] = []
    specs = _writer_specs(logger_cfg, settings, config)
    tb_dir = logger_cfg.tensorboard_dir
    if logger_cfg.metrics_writer_mode == "process":
        if tb_dir is not None:
            # Made here, so that a bad path fails in this process with the OS's own error.
            Path(tb_dir).mkdir(parents=True, exist_ok=True)
            # TensorBoard writes in the writer process too: serialising an event and its
            # checksum (pure Python without TensorFlow) would otherwise cost the training
            # process about a millisecond per step. Its `.backend` in this process is still
            # a real SummaryWriter of the same directory, made on first use.
            tb_spec = {"log_dir": str(tb_dir), "queue_size": logger_cfg.tensorboard_queue_size}
            specs.insert(0, ("tensorboard", f"{_BACKENDS}:TensorBoardEventWriter", tb_spec))
        if not specs:
            return writers
        process = WriterProcess(specs)
        try:
            return list(remote_writers(process))
        except BaseException:
            process.close()
            raise
    try:
        if tb_dir is not None:
            writers.append(TensorBoardWriter(tb_dir, logger_cfg.tensorboard_queue_size))
        for kind, _, kwargs in specs:
            writers.append(_INLINE[kind](**kwargs))
    except BaseException:
        for writer in writers:  # do not leave half a set of runs open
            try:
                writer.close()
            except Exception:
                logger.exception("closing the %s writer after a failed build failed", writer.kind)
        raise
    return writers


def _agree_on_failure(failed: bool, world_size: int) -> bool:
    """Whether any rank failed (a MAX all-reduce), so that every rank raises together."""
    if not dist_ready() or dist.get_world_size() != world_size:
        return failed
    return any_rank(failed)


def build_metric_writers(
    logger_cfg: LoggerConfig,
    *,
    rank: int,
    world_size: int,
    run_config: Mapping[str, Any] | Any | None = None,
    backend_settings: BackendSettings | None = None,
    report_settings: ReportSettings | None = None,
    asynchronous: bool = False,
) -> MetricWriters:
    """Build the metric writers of a run: backends on the last rank, nothing elsewhere.

    TensorBoard is on when ``logger_cfg.tensorboard_dir`` is set, Weights & Biases when
    ``wandb_project`` is, MLflow when ``mlflow_experiment`` is, Comet when
    ``comet_project`` is. Backend packages are imported only when configured and only on
    the last rank.

    With ``logger_cfg.metrics_writer_mode="process"`` (the default) the TensorBoard, W&B,
    MLflow and Comet writers run in a metric writer process started here; this returns once
    they are built there, and raises their setup error (missing package, bad tracking URI,
    no API key) if they are not. The ``SummaryWriter`` that ``.tensorboard`` returns is
    made in this process on first access (for code that writes to it directly).

    Call it on every rank. When torch.distributed is initialised with ``world_size``
    ranks, it is a collective: if building fails on the last rank, every rank raises
    (so the others do not wait for it in their next collective).

    Args:
        logger_cfg: The logger section: which backends, where, and the reports.
        rank: Global rank of this process.
        world_size: Number of ranks.
        run_config: The run's configuration (a mapping or a ``ConfigContainer``), logged
            as W&B config and MLflow / Comet parameters.
        backend_settings: Optional overrides of the MLflow / Comet fields of
            ``logger_cfg`` (fields set to anything but their default win).
        report_settings: Optional overrides of the report fields of ``logger_cfg``.
        asynchronous: Also run the writers' calls on a background thread in this process
            (see :class:`MetricWriters`).

    Returns:
        The writers (empty on every rank but the last).

    Raises:
        TypeError: ``logger_cfg`` is not a ``LoggerConfig``, or ``run_config`` or a
            settings override has the wrong type.
        ValueError: ``rank`` / ``world_size`` are invalid, MLflow is on without a
            tracking URI, or Comet online mode has no API key.
        BackendNotInstalledError: A configured backend's package is missing (names the
            extra to install); raised on every rank.
        RuntimeError: A backend could not start (its message says why), or building
            failed on another rank.
    """
    if not isinstance(logger_cfg, LoggerConfig):
        raise TypeError(
            f"logger_cfg must be a bridge.config.LoggerConfig, got {type(logger_cfg).__name__}"
        )
    _check_rank(rank, world_size)
    settings = backend_settings_for(logger_cfg, backend_settings)
    reports = report_settings_for(logger_cfg, report_settings)
    config = _plain_config(run_config)
    _check_backends(logger_cfg, settings)

    writers: list[MetricWriter] = []
    error: BaseException | None = None
    if rank == world_size - 1:
        try:
            writers = _build_backends(logger_cfg, settings, config)
        except Exception as exc:
            error = exc
    if _agree_on_failure(error is not None, world_size) and error is None:
        for writer in writers:
            writer.close()
        raise RuntimeError(
            f"building the metric writers failed on rank {world_size - 1}; see its error"
        )
    if error is not None:
        raise error
    return MetricWriters(writers, report_settings=reports, asynchronous=asynchronous)
