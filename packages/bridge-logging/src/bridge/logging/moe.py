"""A TensorBoard-shaped writer that also reaches MLflow and Comet, for megatron's MoE/MTP helpers.

megatron-core's ``track_moe_metrics`` and ``MTPLossLoggingHelper.track_mtp_metrics`` write
through ``writer.add_scalar(name, value, iteration)`` (and ``wandb_writer.log``). They know
nothing of MLflow or Comet; the trainer passes them the writer built here instead of the
bare TensorBoard writer so those backends see the same values. W&B keeps receiving the
run directly.
"""

from __future__ import annotations

from typing import Any

import torch

from bridge.logging.backends import mlflow_metric_name

__all__ = ["MoeMetricFanoutWriter", "build_moe_metric_writer"]


class MoeMetricFanoutWriter:
    """SummaryWriter-shaped adapter that fans ``add_scalar`` to MLflow / Comet.

    Args:
        tb_writer: The TensorBoard ``SummaryWriter`` or ``None``.
        comet_logger: A Comet experiment (``log_metrics(dict, step=)``) or ``None``.
        mlflow_logger: The ``mlflow`` module with an active run (``log_metrics(dict,
            step=)``) or ``None``.
    """

    def __init__(
        self, tb_writer: Any | None, comet_logger: Any | None, mlflow_logger: Any | None
    ) -> None:
        self._tb_writer = tb_writer
        self._comet_logger = comet_logger
        self._mlflow_logger = mlflow_logger

    @staticmethod
    def _sanitize(value: Any) -> Any:
        """Convert 0-d (one-element) torch tensors to Python scalars; pass other values through."""
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return value.detach().reshape(()).item()
        return value

    def add_scalar(self, name: str, value: Any, iteration: int) -> None:
        """Forward an ``add_scalar`` call to TensorBoard (if any), MLflow and Comet.

        TensorBoard gets the value untouched; MLflow and Comet get a Python scalar, and
        MLflow a metric name it accepts.
        """
        if self._tb_writer is not None:
            self._tb_writer.add_scalar(name, value, iteration)
        if self._mlflow_logger is None and self._comet_logger is None:
            return
        scalar = self._sanitize(value)
        if self._mlflow_logger is not None:
            self._mlflow_logger.log_metrics({mlflow_metric_name(name): scalar}, step=iteration)
        if self._comet_logger is not None:
            self._comet_logger.log_metrics({name: scalar}, step=iteration)


def build_moe_metric_writer(
    tb_writer: Any | None, comet_logger: Any | None, mlflow_logger: Any | None
) -> Any | None:
    """Return a writer suitable for megatron-core's MoE/MTP metric helpers.

    Args:
        tb_writer: The TensorBoard writer (``MetricWriters.tensorboard``) or ``None``.
        comet_logger: ``MetricWriters.comet`` or ``None``.
        mlflow_logger: ``MetricWriters.mlflow`` or ``None``.

    Returns:
        ``tb_writer`` itself when neither MLflow nor Comet is configured (no overhead);
        otherwise a :class:`MoeMetricFanoutWriter` over all three, even when
        ``tb_writer`` is ``None``, so MoE/MTP metrics reach MLflow / Comet without
        TensorBoard.
    """
    if comet_logger is None and mlflow_logger is None:
        return tb_writer
    return MoeMetricFanoutWriter(tb_writer, comet_logger, mlflow_logger)


# The reference's (private) spellings.
_MoeMetricFanoutWriter = MoeMetricFanoutWriter
_build_moe_metric_writer = build_moe_metric_writer
