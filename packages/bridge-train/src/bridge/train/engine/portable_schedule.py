"""A no-pipelining forward/backward schedule with megatron's signature, on any device.

megatron-core's ``forward_backward_no_pipelining`` keeps its token counter on CUDA. This
schedule runs the same loop with megatron's own ``forward_step`` and ``backward_step``
(so loss-function conventions are megatron's, unchanged) and a counter on the model's
device:

* a loss function returning ``(loss, num_tokens, reported)`` has its loss divided by
  ``num_tokens`` and by ``num_microbatches`` (unless ``config.calculate_per_token_loss``,
  where ``finalize_model_grads`` divides the gradients by the global token count);
* a loss function returning ``(loss, reported)`` has its loss divided by
  ``num_microbatches`` (and multiplied by the context-parallel size);
* all micro-batches but the last run inside ``config.no_sync_func()``; afterwards
  ``config.finalize_model_grads_func(model, num_tokens?, pg_collection=...)`` reduces the
  gradients; ``config.grad_scale_func`` scales the loss before backward;
* the list of per-micro-batch ``reported`` objects is returned, exactly as megatron does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from megatron.core.pipeline_parallel.schedules import backward_step, forward_step
from megatron.core.utils import get_model_config

__all__ = ["forward_backward_no_pipelining"]


def _default_pg_collection() -> Any:
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgc = ProcessGroupCollection()
    pgc.tp = parallel_state.get_tensor_model_parallel_group()
    pgc.cp = parallel_state.get_context_parallel_group()
    pgc.pp = parallel_state.get_pipeline_model_parallel_group()
    pgc.embd = parallel_state.get_embedding_group(check_initialized=False)
    pgc.pos_embd = parallel_state.get_position_embedding_group(check_initialized=False)
    pgc.dp = parallel_state.get_data_parallel_group()
    pgc.dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    pgc.tp_dp_cp = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    return pgc


def _model_device(model: torch.nn.Module) -> torch.device:
    for param in model.parameters():
        return param.device
    return torch.device("cpu")


def forward_backward_no_pipelining(
    *,
    forward_step_func: Callable[..., Any],
    data_iterator: Iterator[Any] | list[Iterator[Any]] | None,
    model: torch.nn.Module | list[torch.nn.Module],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn: Callable[..., Any] | None = None,
    p2p_communicator: Any = None,
    pg_collection: Any = None,
    force_all_reduce: bool | None = False,
) -> list[Any]:
    """Run forward (and backward) over ``num_microbatches`` micro-batches on one model chunk.

    Arguments follow megatron-core's ``forward_backward_func``; ``seq_length``,
    ``micro_batch_size``, ``decoder_seq_length`` and ``p2p_communicator`` are accepted and
    unused (there is no pipeline communication).

    Args:
        forward_step_func: ``(data_iterator, model) -> (output_tensor, loss_func)``.
        data_iterator: Iterator of micro-batches (or a 1-element list of one).
        model: The model chunk (or a 1-element list).
        num_microbatches: Micro-batches in this global batch on this rank.
        seq_length: Unused.
        micro_batch_size: Unused.
        decoder_seq_length: Unused.
        forward_only: Skip backward and gradient finalisation (evaluation).
        collect_non_loss_data: Call ``loss_func(output, non_loss_data=True)`` and collect
            what it returns.
        first_val_step: First validation step (passed on as megatron does).
        adjust_tensor_shapes_fn: Must be ``None`` (pipelining only).
        p2p_communicator: Unused.
        pg_collection: Process groups (``tp``, ``cp``, ``pp``, ``dp_cp``, ``embd``,
            ``pos_embd``); default: megatron's parallel state.
        force_all_reduce: Passed to ``finalize_model_grads_func``.

    Returns:
        The list of what the loss function reported for each micro-batch (or the collected
        non-loss data), on the last pipeline stage.

    Raises:
        ValueError: More than one model chunk or data iterator, ``num_microbatches < 1``,
            or ``adjust_tensor_shapes_fn`` given.
    """
    del seq_length, micro_batch_size, decoder_seq_length, p2p_communicator
    if isinstance(model, list):
        if len(model) != 1:
            raise ValueError(
                f"the no-pipelining schedule runs one model chunk, got {len(model)}; virtual "
                "pipelining needs the megatron engine"
            )
        model = model[0]
    if isinstance(data_iterator, list):
        if len(data_iterator) != 1:
            raise ValueError(
                f"the no-pipelining schedule takes one data iterator, got {len(data_iterator)}"
            )
        data_iterator = data_iterator[0]
    if adjust_tensor_shapes_fn is not None:
        raise ValueError("adjust_tensor_shapes_fn is only supported by pipeline schedules")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if pg_collection is None:
        pg_collection = _default_pg_collection()

    config = get_model_config(model)
    if config.timers is not None:
        config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
    no_sync_func = config.no_sync_func or contextlib.nullcontext
    cp_size = pg_collection.cp.size()
    forward_data_store: list[Any] = []
    total_num_tokens = torch.zeros([], dtype=torch.int, device=_model_device(model))

    def run(index: int) -> None:
        nonlocal total_num_tokens
        is_first = num_microbatches == 1 if index == num_microbatches - 1 else index == 0
        if first_val_step is not None and forward_only:
            is_first = first_val_step and is_first
        output_tensor, num_tokens = forward_step(
            forward_step_func,
            data_iterator,
            model,
            num_microbatches,
            None,
            forward_data_store,
            config,
            cp_size,
            collect_non_loss_data,
            is_first_microbatch=is_first,
            current_microbatch=index,
            is_last_stage=True,
        )
        total_num_tokens = total_num_tokens + num_tokens.to(total_num_tokens.device)
        if not forward_only:
            backward_step(None, output_tensor, None, config)

    with no_sync_func():
        for index in range(num_microbatches - 1):
            run(index)
    # The last micro-batch runs outside no_sync so its backward starts the grad reduction.
    run(num_microbatches - 1)

    if config.finalize_model_grads_func is not None and not forward_only:
        config.finalize_model_grads_func(
            [model],
            total_num_tokens if config.calculate_per_token_loss else None,
            pg_collection=pg_collection,
            force_all_reduce=force_all_reduce,
        )
    if config.timers is not None:
        config.timers("forward-backward").stop()
    return forward_data_store
