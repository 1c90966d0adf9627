"""Global batch size per iteration: constant, or ramped up with ``train.rampup_batch_size``.

megatron-core's ``num_microbatches_calculator`` decides how many micro-batches an iteration
runs. In megatron-core 0.19.2 its ``rampup_batch_size`` argument is ignored (deprecated);
ramp-up is spelled as a step schedule ``"<samples>:<batch size> ..."``. This module turns
the config's ``[start, increment, ramp-up samples]`` into that schedule with the classic
ramp-up semantics: the batch starts at ``start`` and grows by ``increment`` every
``ramp-up samples / ((global_batch_size - start) / increment)`` consumed samples until it
reaches ``global_batch_size``.
"""

from __future__ import annotations

import math

from megatron.core import num_microbatches_calculator as nmc

from bridge.config import TrainingConfig, rampup_increments
from core_utils.distributed import global_rank

__all__ = ["ensure_num_microbatches_calculator", "rampup_to_step_schedule"]


def rampup_to_step_schedule(rampup_batch_size: list[int], global_batch_size: int) -> str:
    """megatron-core's step schedule for a classic batch-size ramp-up.

    Args:
        rampup_batch_size: ``[start batch size, increment, ramp-up samples]``.
        global_batch_size: The batch size at the end of the ramp-up.

    Returns:
        ``"0:<start> <t1>:<start + increment> ... <tn>:<global_batch_size>"`` with thresholds
        in consumed samples.

    Raises:
        ConfigError: The values do not describe a ramp-up to ``global_batch_size``, as
            bridge-config's section and ``rampup_increments`` refuse them.
    """
    # Built as a section: its own check of the values and bridge-config's one rule about
    # the ramp-up and the global batch apply to these raw values too.
    train = TrainingConfig(rampup_batch_size=rampup_batch_size, global_batch_size=global_batch_size)
    steps = rampup_increments(train)
    start, increment, samples = (int(v) for v in rampup_batch_size)
    entries = [(0, start)]
    if steps:
        per_step = samples / steps
        previous = 0
        for k in range(1, steps + 1):
            # Classic ramp-up: the k-th increment applies once k * per_step samples are
            # consumed; thresholds must increase strictly.
            threshold = max(math.ceil(k * per_step), previous + 1)
            entries.append((threshold, start + k * increment))
            previous = threshold
    return " ".join(f"{t}:{b}" for t, b in entries)


def ensure_num_microbatches_calculator(
    train_config: TrainingConfig, data_parallel_size: int
) -> bool:
    """Initialise megatron's global micro-batch calculator from ``train_config`` if needed.

    Args:
        train_config: ``TrainingConfig`` (``global_batch_size``, ``micro_batch_size``,
            ``rampup_batch_size``, ``decrease_batch_size_if_needed``).
        data_parallel_size: Data-parallel size.

    Returns:
        True if this call created the calculator (the caller then releases it with
        megatron's ``destroy_num_microbatches_calculator``), False if one existed.
    """
    if nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None:
        return False

    rank = global_rank()
    schedule = None
    if train_config.rampup_batch_size is not None:
        # validate() refused ramp-up with decrease_batch_size_if_needed, which megatron-core's
        # step schedules do not support.
        assert train_config.global_batch_size is not None  # validate() fills it in
        schedule = rampup_to_step_schedule(
            train_config.rampup_batch_size, train_config.global_batch_size
        )
    nmc.init_num_microbatches_calculator(
        rank,
        None,
        train_config.global_batch_size,
        train_config.micro_batch_size,
        data_parallel_size,
        train_config.decrease_batch_size_if_needed,
        step_batch_size_schedule=schedule,
    )
    return True
