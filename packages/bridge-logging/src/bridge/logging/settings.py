"""Programmatic overrides of the MLflow, Comet and report fields of ``LoggerConfig``.

Every backend and report is configured by ``bridge.config.LoggerConfig`` (so YAML recipes
and ``bridge-train logger.x=y`` reach it). :class:`BackendSettings` and
:class:`ReportSettings` predate those fields and stay as optional overrides for code that
builds them (``build_metric_writers(..., backend_settings=, report_settings=)``): a field
set in them to anything but its default wins over the ``LoggerConfig`` field of the same
meaning; fields left at their default come from ``LoggerConfig``. Both dataclasses check
their values when built and raise :class:`bridge.config.ConfigError` naming the field and
the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from bridge.config import ConfigError, LoggerConfig

__all__ = [
    "REPORT_SOURCE_FIELDS",
    "TIME_UNITS",
    "BackendSettings",
    "ReportSettings",
    "backend_settings_for",
    "report_settings_for",
]

TIME_UNITS: dict[str, float] = {"seconds": 1.0, "minutes": 60.0, "hours": 3600.0, "days": 86400.0}
"""Seconds per unit for :func:`bridge.logging.report_runtime`."""

COMET_MODES = ("auto", "online", "offline")


def _non_empty(owner: str, name: str, value: str | None) -> None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ConfigError(
            f"{owner}.{name}", f"got {value!r}; expected a non-empty string or None (unset)"
        )


@dataclass(kw_only=True)
class BackendSettings:
    """Overrides of the MLflow and Comet fields of ``LoggerConfig`` (same names and meaning).

    A backend is on when its project/experiment is set here or in ``LoggerConfig``.
    """

    mlflow_experiment: str | None = None
    """MLflow experiment name; setting it turns MLflow logging on."""

    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI (``http://host:5000``, ``databricks``, ``file:/path/mlruns``).
    Unset: the ``MLFLOW_TRACKING_URI`` environment variable, which must then be set. MLflow
    3 refuses ``file:`` stores unless ``MLFLOW_ALLOW_FILE_STORE=true`` is exported."""

    mlflow_run_name: str | None = None
    """MLflow run name (unset: ``LoggerConfig.wandb_exp_name`` if set, else MLflow's)."""

    mlflow_tags: dict[str, str] | None = None
    """Tags set on the MLflow run."""

    comet_project: str | None = None
    """Comet project name; setting it turns Comet logging on."""

    comet_workspace: str | None = None
    """Comet workspace (unset: the API key's default workspace)."""

    comet_experiment_name: str | None = None
    """Comet experiment name (unset: ``LoggerConfig.wandb_exp_name`` if set)."""

    comet_tags: list[str] | None = None
    """Tags added to the Comet experiment."""

    comet_mode: Literal["auto", "online", "offline"] = "auto"
    """``"online"`` needs an API key (``COMET_API_KEY`` or ``~/.comet.config``).
    ``"offline"`` writes a zip archive to upload later with ``comet upload``. ``"auto"``:
    offline when ``COMET_MODE=offline`` is exported or no API key is configured (a notice
    says where the archive goes), online otherwise."""

    comet_offline_dir: str | None = None
    """Directory for offline archives (unset: ``COMET_OFFLINE_DIRECTORY`` or ``.cometml-runs``)."""

    def __post_init__(self) -> None:
        """Check that names are non-empty strings and that ``comet_mode`` is known."""
        for name in (
            "mlflow_experiment",
            "mlflow_tracking_uri",
            "mlflow_run_name",
            "comet_project",
            "comet_workspace",
            "comet_experiment_name",
            "comet_offline_dir",
        ):
            _non_empty("BackendSettings", name, getattr(self, name))
        if self.mlflow_tags is not None and not isinstance(self.mlflow_tags, dict):
            raise ConfigError(
                "BackendSettings.mlflow_tags", f"got {self.mlflow_tags!r}; expected a dict or None"
            )
        if self.comet_tags is not None and not isinstance(self.comet_tags, list):
            raise ConfigError(
                "BackendSettings.comet_tags", f"got {self.comet_tags!r}; expected a list or None"
            )
        if self.comet_mode not in COMET_MODES:
            raise ConfigError(
                "BackendSettings.comet_mode",
                f"got {self.comet_mode!r}; expected one of {', '.join(map(repr, COMET_MODES))}",
            )


@dataclass(kw_only=True)
class ReportSettings:
    """Overrides of the report fields of ``LoggerConfig`` read by
    :func:`bridge.logging.training_log`."""

    throughput_window_size: int | None = None
    """Iterations in the rolling window of ``throughput/*`` (written when
    ``LoggerConfig.log_throughput`` is on). Unset: ``LoggerConfig.throughput_window_size``,
    else ``LoggerConfig.log_interval``."""

    log_runtime: bool = False
    """Write ``time/remaining_estimate``, ``time/tokens``, ``time/samples``,
    ``time/batches`` and ``time/total`` every ``tensorboard_log_interval``
    (``LoggerConfig.log_runtime_to_tensorboard``)."""

    runtime_time_unit: str = "seconds"
    """Unit of the ``time/*`` durations: seconds, minutes, hours or days
    (``LoggerConfig.runtime_time_unit``)."""

    log_l2_norm_grad: bool = False
    """Write ``l2_norm/grad/global`` and one ``l2_norm/grad/<parameter>`` per parameter
    every ``tensorboard_log_interval`` (a collective over the model-parallel group;
    ``LoggerConfig.log_l2_norm_grad_to_tensorboard``)."""

    memory_keys: dict[str, str] | None = None
    """``torch.cuda.memory_stats()`` keys to report and the names to report them under
    (unset: ``LoggerConfig.memory_keys``, else :data:`bridge.logging.MEMORY_KEYS`)."""

    def __post_init__(self) -> None:
        """Check the window size, the time unit and the memory keys."""
        window = self.throughput_window_size
        if window is not None and (
            isinstance(window, bool) or not isinstance(window, int) or window < 1
        ):
            raise ConfigError(
                "ReportSettings.throughput_window_size",
                f"got {window!r}; expected a positive number of iterations or None "
                "(None uses LoggerConfig.log_interval)",
            )
        if self.runtime_time_unit not in TIME_UNITS:
            raise ConfigError(
                "ReportSettings.runtime_time_unit",
                f"got {self.runtime_time_unit!r}; expected one of {', '.join(TIME_UNITS)}",
            )
        if self.memory_keys is not None and (
            not isinstance(self.memory_keys, dict)
            or not self.memory_keys
            or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.memory_keys.items()
            )
        ):
            raise ConfigError(
                "ReportSettings.memory_keys",
                f"got {self.memory_keys!r}; expected a non-empty dict mapping "
                "torch.cuda.memory_stats() keys to report names, or None for MEMORY_KEYS",
            )


# ReportSettings field -> the LoggerConfig field of the same meaning.
_REPORT_FIELDS = {
    "throughput_window_size": "throughput_window_size",
    "log_runtime": "log_runtime_to_tensorboard",
    "runtime_time_unit": "runtime_time_unit",
    "log_l2_norm_grad": "log_l2_norm_grad_to_tensorboard",
    "memory_keys": "memory_keys",
}


REPORT_SOURCE_FIELDS: tuple[str, ...] = tuple(_REPORT_FIELDS.values())
"""The ``LoggerConfig`` fields :func:`report_settings_for` reads."""


def _merge[Settings: (BackendSettings, ReportSettings)](
    cls: type[Settings],
    logger_cfg: LoggerConfig,
    override: Settings | None,
    names: dict[str, str],
) -> Settings:
    if override is not None and not isinstance(override, cls):
        raise TypeError(
            f"{cls.__name__.replace('Settings', '_settings').lower()} must be a "
            f"{cls.__name__} or None, got {type(override).__name__}"
        )
    default = cls()
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        own = getattr(override, field.name, None) if override is not None else None
        if override is not None and own != getattr(default, field.name):
            values[field.name] = own
        else:
            values[field.name] = getattr(logger_cfg, names.get(field.name, field.name))
    return cls(**values)


def backend_settings_for(
    logger_cfg: LoggerConfig, override: BackendSettings | None = None
) -> BackendSettings:
    """The MLflow / Comet settings of a run: ``LoggerConfig``'s, with ``override``'s set fields.

    Raises:
        TypeError: ``override`` is not a :class:`BackendSettings`.
    """
    return _merge(BackendSettings, logger_cfg, override, {})


def report_settings_for(
    logger_cfg: LoggerConfig, override: ReportSettings | None = None
) -> ReportSettings:
    """The report settings of a run: ``LoggerConfig``'s, with ``override``'s set fields.

    Raises:
        TypeError: ``override`` is not a :class:`ReportSettings`.
    """
    return _merge(ReportSettings, logger_cfg, override, _REPORT_FIELDS)
