"""LoggerConfig's MLflow, Comet, report and writer-mode fields: defaults, YAML, overrides, errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bridge.config import ConfigContainer, ConfigError, LoggerConfig, apply_overrides, load_config

BACKEND_SWITCHES = ("tensorboard_dir", "wandb_project", "mlflow_experiment", "comet_project")


def test_defaults_keep_every_backend_off_and_use_the_writer_process() -> None:
    cfg = LoggerConfig()
    assert all(getattr(cfg, name) is None for name in BACKEND_SWITCHES)
    assert cfg.metrics_writer_mode == "process"
    assert cfg.comet_mode == "auto"
    assert (cfg.mlflow_tags, cfg.comet_tags, cfg.memory_keys) == (None, None, None)
    assert (cfg.throughput_window_size, cfg.runtime_time_unit) == (None, "seconds")
    assert not cfg.log_runtime_to_tensorboard and not cfg.log_l2_norm_grad_to_tensorboard


def test_command_line_overrides_reach_every_backend_field(container: ConfigContainer) -> None:
    cfg = apply_overrides(
        container,
        [
            "logger.mlflow_experiment=pretrain",
            "logger.mlflow_tracking_uri=file:./mlruns",
            "logger.mlflow_run_name=run-7",
            "logger.mlflow_tags={team: nlp, size: 125}",
            "logger.comet_project=pretrain",
            "logger.comet_workspace=lab",
            "logger.comet_experiment_name=run-7",
            "logger.comet_tags=[baseline, cpu]",
            "logger.comet_mode=offline",
            "logger.comet_offline_dir=/tmp/comet",
            "logger.metrics_writer_mode=inline",
            "logger.throughput_window_size=20",
            "logger.log_runtime_to_tensorboard=true",
            "logger.runtime_time_unit=hours",
            "logger.log_l2_norm_grad_to_tensorboard=true",
            "logger.memory_keys={allocated_bytes.all.peak: peak_allocated_mem}",
        ],
    )
    logger = cfg.logger
    assert logger is not None
    assert (logger.mlflow_experiment, logger.mlflow_tracking_uri) == ("pretrain", "file:./mlruns")
    assert logger.mlflow_tags == {"team": "nlp", "size": "125"}  # tag values are strings
    assert logger.comet_tags == ["baseline", "cpu"]
    assert (logger.comet_mode, logger.comet_offline_dir) == ("offline", "/tmp/comet")
    assert logger.metrics_writer_mode == "inline"
    assert (logger.throughput_window_size, logger.runtime_time_unit) == (20, "hours")
    assert logger.memory_keys == {"allocated_bytes.all.peak": "peak_allocated_mem"}


def test_backend_fields_round_trip_through_yaml(container: ConfigContainer, tmp_path: Path) -> None:
    container.logger = LoggerConfig(
        mlflow_experiment="e",
        mlflow_tracking_uri="http://mlflow:5000",
        mlflow_tags={"a": "b"},
        comet_project="p",
        comet_tags=["x"],
        metrics_writer_mode="inline",
    )
    path = tmp_path / "recipe.yaml"
    container.to_yaml(path)
    assert load_config(path).logger == container.logger


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "mlflow_experiment",
            "",
            r"LoggerConfig.mlflow_experiment: got ''; expected a non-empty string, or null",
        ),
        (
            "comet_project",
            "  ",
            r"LoggerConfig.comet_project: got '  '; expected a non-empty string",
        ),
        ("mlflow_tracking_uri", "", r"LoggerConfig.mlflow_tracking_uri: got ''"),
        (
            "comet_mode",
            "sometimes",
            r"LoggerConfig.comet_mode: got 'sometimes'; expected one of 'auto', 'online', 'offline'",
        ),
        (
            "metrics_writer_mode",
            "thread",
            r"LoggerConfig.metrics_writer_mode: got 'thread'; expected one of 'process', 'inline'",
        ),
        (
            "runtime_time_unit",
            "weeks",
            r"LoggerConfig.runtime_time_unit: got 'weeks'; expected one of 'seconds', 'minutes', 'hours', 'days'",
        ),
        (
            "throughput_window_size",
            0,
            r"LoggerConfig.throughput_window_size: got 0; expected a positive integer",
        ),
        ("memory_keys", {}, r"LoggerConfig.memory_keys: got \{\}; expected a non-empty mapping"),
        (
            "comet_tags",
            ["ok", ""],
            r"LoggerConfig.comet_tags: got \['ok', ''\]; tags must be non-empty strings",
        ),
        (
            "mlflow_tags",
            {"": "x"},
            r"LoggerConfig.mlflow_tags: got \{'': 'x'\}; tags must be non-empty strings",
        ),
        ("comet_tags", "solo", r"LoggerConfig.comet_tags"),
    ],
)
def test_bad_backend_values_name_the_field(field: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        LoggerConfig(**{field: value})
