"""Mixture-of-experts metrics: the load-balancing and router z-losses of every step.

megatron-core's router records its auxiliary losses per layer in a tracker while it runs
(``get_moe_metrics_tracker().record``); :func:`report_moe_metrics` reduces them across the
pipeline and data-parallel ranks, averages them over the MoE layers and micro-batches, adds
them to the interval's loss accumulator (so the console line shows their interval mean
beside ``lm loss``) and writes them to the metric writers, the way Megatron-LM's training
log calls ``track_moe_metrics``. Metric names are megatron's: ``load_balancing_loss``
(``aux_loss``), ``seq_load_balancing_loss`` (``seq_aux_loss``),
``global_load_balancing_loss`` (``global_aux_loss``) and ``z_loss`` (with
``moe_z_loss_coeff``); with ``moe_per_layer_logging`` also ``moe/<name>_layer_<i>``.
"""

from __future__ import annotations

from typing import Any

from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

__all__ = ["moe_track_names", "report_moe_metrics"]

_BALANCING_METRICS = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}


def moe_track_names(model_config: TransformerConfig) -> list[str]:
    """The auxiliary-loss metrics the model's router records (empty for dense models)."""
    if not getattr(model_config, "num_moe_experts", None):
        return []
    kinds = model_config.moe_router_load_balancing_type
    names = [
        _BALANCING_METRICS[kind]
        for kind in (kinds if isinstance(kinds, list) else [kinds])
        if kind in _BALANCING_METRICS
    ]
    if getattr(model_config, "moe_z_loss_coeff", None) is not None:
        names.append("z_loss")
    return names


def report_moe_metrics(
    model_config: TransformerConfig,
    iteration: int,
    num_microbatches: int,
    writer: Any | None,
    total_loss_dict: dict[str, Any] | None,
) -> str:
    """Reduce, log and clear this step's MoE auxiliary losses (collective: every rank).

    Args:
        model_config: The model config (``num_moe_experts``, the balancing type,
            ``moe_z_loss_coeff``, ``num_layers``, ``moe_layer_freq``, ...).
        iteration: The completed step.
        num_microbatches: Micro-batches of the step (the losses are summed over them).
        writer: Where to write the scalars (``add_scalar(name, value, step)``: the run's
            :class:`bridge.logging.MetricWriters`, which reach every configured backend), or
            ``None`` on steps that write nothing.
        total_loss_dict: The interval's loss accumulator (the console line's averages).

    Returns:
        megatron's console text for the non-loss metrics (empty for dense models).
    """
    names = moe_track_names(model_config)
    if not names:
        return ""

    return str(
        get_moe_metrics_tracker().report(
            loss_scale=1.0 / max(int(num_microbatches), 1),
            iteration=iteration,
            writer=writer,
            wandb_writer=None,  # the MetricWriters fan-out includes W&B
            per_layer_logging=bool(getattr(model_config, "moe_per_layer_logging", False)),
            force_initialize=True,  # pipeline stages without MoE layers join the reduction
            track_names=names,
            num_layers=int(model_config.num_layers),
            moe_layer_freq=model_config.moe_layer_freq,
            mtp_num_layers=getattr(model_config, "mtp_num_layers", None),
            total_loss_dict=total_loss_dict,
        )
    )
