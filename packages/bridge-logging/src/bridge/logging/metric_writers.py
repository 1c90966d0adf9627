"""``MetricWriters``: the fan-out over every configured backend, and how it is built."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import torch
import torch.distributed as dist

from bridge.config import LoggerConfig
from bridge.logging._dist import collective_device, dist_ready
from bridge.logging._worker import WriterThread
from bridge.logging.backends import (
    CometWriter,
    MetricWriter,
    MlflowWriter,
    TensorBoardWriter,
    WandbWriter,
    require_backend,
    to_scalar,
)
from bridge.logging.settings import BackendSettings, ReportSettings

logger = logging.getLogger("bridge.logging")


@dataclass
class _IntervalMarks:
    """What ``training_log`` remembers between calls (one instance per run)."""

    previous_flops: float | None = None
    known_flops: float = 0.0
    known_iterations: int = 0
    energy_monitor: Any = None
    energy_unavailable: bool = False


class MetricWriters:
    """Every configured metric backend behind one ``add_scalar`` / ``log_metrics``.

    Built by :func:`build_metric_writers` on every rank; only the last rank holds
    backends, elsewhere it is empty (``enabled`` is false and writes do nothing), so
    code can call it unconditionally.

    With ``asynchronous=True`` the backend calls run in order on one background thread,
    so a training step only pays for turning values into floats. It is meant for steps
    where the training thread mostly waits (on the GPU, on remote backends); in CPU
    training the thread competes for the GIL and does not shorten the step
    (``benchmarks/logging_overhead.py`` measures both). Values are converted (and bad
    ones rejected) in the caller; a backend error surfaces as ``RuntimeError`` at the next
    call. Reading a backend attribute (``.tensorboard``, ``.wandb``, ``.mlflow``,
    ``.comet``) first waits for the queued calls, so code that then writes to the backend
    directly (megatron's MoE helpers) stays in step order.

    Args:
        writers: The backends to fan out to.
        report_settings: Optional reports for :func:`bridge.logging.training_log`.
        asynchronous: Run the backend calls on a background thread.
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
        self._writers: tuple[MetricWriter, ...] = tuple(writers)
        self._closed = False
        self._worker = WriterThread() if asynchronous and self._writers else None
        self.report_settings = report_settings or ReportSettings()
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
    def asynchronous(self) -> bool:
        """Whether backend calls run on a background thread."""
        return self._worker is not None

    @property
    def tensorboard(self) -> Any:
        """The TensorBoard ``SummaryWriter``, or ``None``."""
        return self._backend("tensorboard")

    @property
    def wandb(self) -> Any:
        """The W&B run, or ``None``."""
        return self._backend("wandb")

    @property
    def mlflow(self) -> Any:
        """The ``mlflow`` module with the run active, or ``None``."""
        return self._backend("mlflow")

    @property
    def comet(self) -> Any:
        """The Comet experiment, or ``None``."""
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
            RuntimeError: The writers are closed, or a backend failed in the background.
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
            RuntimeError: The writers are closed, or a backend failed in the background.
            ValueError: A value is not a single number.
        """
        self._check_open()
        if not metrics or not self._writers:
            return
        values = {tag: to_scalar(tag, value) for tag, value in metrics.items()}
        for writer in self._writers:
            if only is None or writer.kind in only:
                self._run(writer.log_metrics, values, step)

    def flush(self) -> None:
        """Flush every backend and wait for it (a no-op once closed).

        Raises:
            RuntimeError: A backend failed in the background.
        """
        if self._closed:
            return
        for writer in self._writers:
            self._run(writer.flush)
        if self._worker is not None:
            self._worker.drain()

    def close(self) -> None:
        """Write what is queued and close every backend. Idempotent and never raises.

        A backend that fails (now or earlier in the background) is logged at ERROR level
        and the others are still closed, so this is safe in a ``finally`` block.
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
    """Fail on every rank, before anything is built, when a configured package is missing."""
    if logger_cfg.tensorboard_dir is not None:
        require_backend("tensorboard", "LoggerConfig.tensorboard_dir")
    if logger_cfg.wandb_project is not None:
        require_backend("wandb", "LoggerConfig.wandb_project")
    if settings.mlflow_experiment is not None:
        require_backend("mlflow", "BackendSettings.mlflow_experiment")
    if settings.comet_project is not None:
        require_backend("comet", "BackendSettings.comet_project")


def _build_backends(
    logger_cfg: LoggerConfig, settings: BackendSettings, config: Mapping[str, Any] | None
) -> list[MetricWriter]:
    writers: list[MetricWriter] = []
    try:
        if logger_cfg.tensorboard_dir is not None:
            writers.append(
                TensorBoardWriter(logger_cfg.tensorboard_dir, logger_cfg.tensorboard_queue_size)
            )
        if logger_cfg.wandb_project is not None:
            writers.append(
                WandbWriter(
                    logger_cfg.wandb_project,
                    name=logger_cfg.wandb_exp_name,
                    entity=logger_cfg.wandb_entity,
                    save_dir=logger_cfg.wandb_save_dir,
                    config=config,
                )
            )
        if settings.mlflow_experiment is not None:
            writers.append(
                MlflowWriter(
                    settings.mlflow_experiment,
                    tracking_uri=settings.mlflow_tracking_uri,
                    run_name=settings.mlflow_run_name or logger_cfg.wandb_exp_name,
                    config=config,
                )
            )
        if settings.comet_project is not None:
            writers.append(
                CometWriter(
                    settings.comet_project,
                    workspace=settings.comet_workspace,
                    name=settings.comet_experiment_name or logger_cfg.wandb_exp_name,
                    mode=settings.comet_mode,
                    offline_dir=settings.comet_offline_dir,
                    config=config,
                )
            )
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
    if not dist_ready() or dist.get_world_size() != world_size or world_size == 1:
        return failed
    flag = torch.tensor([1.0 if failed else 0.0], device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


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
    ``logger_cfg.wandb_project`` is, MLflow when ``backend_settings.mlflow_experiment``
    is, Comet when ``backend_settings.comet_project`` is. Backend packages are imported
    only when configured and only on the last rank.

    Call it on every rank. When torch.distributed is initialised with ``world_size``
    ranks, it is a collective: if building fails on the last rank, every rank raises
    (so the others do not wait for it in their next collective).

    Args:
        logger_cfg: Console, TensorBoard and W&B settings.
        rank: Global rank of this process.
        world_size: Number of ranks.
        run_config: The run's configuration (a mapping or a ``ConfigContainer``), logged
            as W&B config and MLflow / Comet parameters.
        backend_settings: MLflow and Comet settings.
        report_settings: Optional reports written by ``training_log``.
        asynchronous: Run the backend calls on a background thread (see
            :class:`MetricWriters`); ``False`` runs them in the caller.

    Returns:
        The writers (empty on every rank but the last).

    Raises:
        TypeError: ``logger_cfg`` is not a ``LoggerConfig`` or ``run_config`` has the
            wrong type.
        ValueError: ``rank`` / ``world_size`` are invalid.
        BackendNotInstalledError: A configured backend's package is missing (names the
            extra to install); raised on every rank.
        RuntimeError: Building failed on another rank.
    """
    if not isinstance(logger_cfg, LoggerConfig):
        raise TypeError(
            f"logger_cfg must be a bridge.config.LoggerConfig, got {type(logger_cfg).__name__}"
        )
    _check_rank(rank, world_size)
    settings = backend_settings or BackendSettings()
    if not isinstance(settings, BackendSettings):
        raise TypeError(
            f"backend_settings must be a BackendSettings, got {type(settings).__name__}"
        )
    if report_settings is not None and not isinstance(report_settings, ReportSettings):
        raise TypeError(
            f"report_settings must be a ReportSettings, got {type(report_settings).__name__}"
        )
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
    return MetricWriters(writers, report_settings=report_settings, asynchronous=asynchronous)
