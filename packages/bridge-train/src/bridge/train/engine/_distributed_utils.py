"""Small helpers shared by the trainer's distributed code (internal)."""

from __future__ import annotations

import copy
from typing import Any

from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection

from core_utils.model_wrapping import ModelOrChunks


def unwrap_model_chunks(model: ModelOrChunks) -> list[Any]:
    """Return ``model`` as a list of model chunks (a single module becomes a 1-list)."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def model_parallel_groups(model: ModelOrChunks | None = None) -> Any:
    """Return a megatron ``ProcessGroupCollection`` for ``model`` (or the global defaults).

    The collection of the (possibly wrapped) first model chunk is used when it has one;
    missing groups are filled from ``megatron.core.parallel_state``.
    """

    pgc = None
    if model is not None:
        chunk = unwrap_model_chunks(model)[0]
        while pgc is None and chunk is not None:
            pgc = getattr(chunk, "pg_collection", None)
            chunk = getattr(chunk, "module", None)
    # A copy: the model's own collection is left exactly as megatron built it.
    pgc = ProcessGroupCollection() if pgc is None else copy.copy(pgc)
    fallbacks = {
        "tp": parallel_state.get_tensor_model_parallel_group,
        "pp": parallel_state.get_pipeline_model_parallel_group,
        "mp": parallel_state.get_model_parallel_group,
        "cp": parallel_state.get_context_parallel_group,
        "tp_ep_pp": parallel_state.get_expert_tensor_model_pipeline_parallel_group,
    }
    for name, getter in fallbacks.items():
        if getattr(pgc, name, None) is None:
            setattr(pgc, name, getter(check_initialized=False))
    if getattr(pgc, "dp_cp", None) is None:
        pgc.dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if getattr(pgc, "dp", None) is None:
        pgc.dp = parallel_state.get_data_parallel_group()
    return pgc
