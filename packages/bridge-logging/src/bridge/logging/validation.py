"""Evaluation results: the console block and the validation / test metrics."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from bridge.logging._dist import print_rank_last
from bridge.logging.metric_writers import tensorboard_only
from bridge.logging.protocols import LoggingState
from bridge.logging.training_log import loss_value

__all__ = ["log_validation_results", "perplexity", "validation_line"]

PPL_CAP = 20.0
"""Losses above this are capped before ``exp`` so perplexity stays finite (as Megatron)."""


def perplexity(loss: float) -> float:
    """``exp(min(20, loss))``."""
    return math.exp(min(PPL_CAP, loss))


def validation_line(prefix: str, losses: Mapping[str, float], split: str = "validation") -> str:
    """The console line of an evaluation's results, without the frame
    :func:`log_validation_results` prints around it::

        validation loss at <prefix> | lm loss value: 2.302585E+00 | lm loss PPL: 1.000000E+01 |

    Args:
        prefix: Where the evaluation happened, e.g. ``"iteration 100"``.
        losses: Loss name -> value averaged over the evaluation.
        split: Name of the evaluated split.

    Returns:
        The line (with its leading space and trailing ``| ``, as Megatron prints it).
    """
    line = f" {split} loss at {prefix} | "
    for key, value in losses.items():
        line += f"{key} value: {value:.6E} | {key} PPL: {perplexity(value):.6E} | "
    return line


def log_validation_results(
    prefix: str,
    loss_dict: Mapping[str, Any],
    iteration: int,
    state: LoggingState,
    *,
    split: str = "validation",
    log_ppl: bool = False,
) -> str:
    """Print evaluation losses with their perplexities and write them to the metric writers.

    Console (last rank), framed by dashes::

        validation loss at <prefix> | lm loss value: 2.302585E+00 | lm loss PPL: 1.000000E+01 |

    Metrics (last rank; ``<split>`` is ``validation`` or ``test``):

    * ``<loss> <split>`` at ``iteration``; TensorBoard also ``<loss> <split> vs samples``
      at ``train_state.consumed_train_samples``.
    * with ``log_ppl`` (the trainer passes ``logger.log_validation_ppl_to_tensorboard``):
      ``<loss> <split> ppl`` (and, on TensorBoard, ``<loss> <split> ppl vs samples``).

    Args:
        prefix: Where the evaluation happened, e.g. ``"iteration 100"``.
        loss_dict: Loss name -> value averaged over the evaluation (a number or a
            one-element tensor).
        iteration: The training iteration the results belong to.
        state: Trainer state (see :class:`bridge.logging.LoggingState`).
        split: Name of the evaluated split, used in the line and the tags.
        log_ppl: Also write the perplexities.

    Returns:
        The console line (also on ranks that do not print it).

    Raises:
        ValueError: ``split`` is empty or a loss is not a single number.
    """
    if not split or not split.strip():
        raise ValueError(f"split must be a non-empty name such as 'validation', got {split!r}")
    losses = {key: loss_value(key, value) for key, value in loss_dict.items()}
    line = validation_line(prefix, losses, split)
    rule = "-" * (len(line) + 1)
    print_rank_last(f"{rule}\n{line}\n{rule}")

    writers = state.metric_writers
    if not writers.enabled:
        return line
    metrics: dict[str, float] = {}
    for key, value in losses.items():
        metrics[f"{key} {split}"] = value
        if log_ppl:
            metrics[f"{key} {split} ppl"] = perplexity(value)
    writers.log_metrics(metrics, iteration)
    samples = int(state.train_state.consumed_train_samples)
    tensorboard_only(writers, {f"{t} vs samples": v for t, v in metrics.items()}, samples)
    return line
