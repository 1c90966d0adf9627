"""Settings bridge-logging needs beyond ``LoggerConfig``: MLflow, Comet and extra reports.

``LoggerConfig`` (bridge.config) covers the console, TensorBoard and Weights & Biases. The
reference has no fields for MLflow, Comet, the rolling throughput window, the runtime
estimate or the per-layer gradient norms, so they live here until ``LoggerConfig`` grows
them. Both dataclasses check their values when built and raise
:class:`bridge.config.ConfigError` naming the field and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from bridge.config import ConfigError

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
    """Where MLflow and Comet write. A backend is on when its project/experiment is set."""

    mlflow_experiment: str | None = None
    """MLflow experiment name; setting it turns MLflow logging on."""

    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI (``http://host:5000``, ``databricks``, ``file:/path/mlruns``).
    Unset: the ``MLFLOW_TRACKING_URI`` environment variable, which must then be set. MLflow
    3 refuses ``file:`` stores unless ``MLFLOW_ALLOW_FILE_STORE=true`` is exported."""

    mlflow_run_name: str | None = None
    """MLflow run name (unset: ``LoggerConfig.wandb_exp_name`` if set, else MLflow's)."""

    comet_project: str | None = None
    """Comet project name; setting it turns Comet logging on."""

    comet_workspace: str | None = None
    """Comet workspace (unset: the API key's default workspace)."""

    comet_experiment_name: str | None = None
    """Comet experiment name (unset: ``LoggerConfig.wandb_exp_name`` if set)."""

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
        if self.comet_mode not in COMET_MODES:
            raise ConfigError(
                "BackendSettings.comet_mode",
                f"got {self.comet_mode!r}; expected one of {', '.join(map(repr, COMET_MODES))}",
            )


@dataclass(kw_only=True)
class ReportSettings:
    """Optional reports :func:`bridge.logging.training_log` adds to the metric writers."""

    throughput_window_size: int | None = None
    """Iterations in the rolling window of ``throughput/*`` (written when
    ``LoggerConfig.log_throughput`` is on). Unset: ``LoggerConfig.log_interval``."""

    log_runtime: bool = False
    """Write ``time/remaining_estimate``, ``time/tokens``, ``time/samples``,
    ``time/batches`` and ``time/total`` every ``tensorboard_log_interval``."""

    runtime_time_unit: str = "seconds"
    """Unit of the ``time/*`` durations: seconds, minutes, hours or days."""

    log_l2_norm_grad: bool = False
    """Write ``l2_norm/grad/global`` and one ``l2_norm/grad/<parameter>`` per parameter
    every ``tensorboard_log_interval`` (a collective over the model-parallel group)."""

    memory_keys: dict[str, str] | None = None
    """``torch.cuda.memory_stats()`` keys to report and the names to report them under
    (unset: :data:`bridge.logging.MEMORY_KEYS`)."""

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
