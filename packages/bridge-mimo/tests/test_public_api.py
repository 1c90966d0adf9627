"""bridge.mimo exposes every name of its reference.

(The package graph, i.e. that bridge.mimo imports no sibling it does not declare, is checked
statically by the workspace guard tests/test_workspace.py, and the nox session proves the
package runs with only its declared dependencies installed.)
"""

from __future__ import annotations

import inspect

import bridge.mimo as mimo

# Every function of Megatron-Bridge's training.megatron_mimo_parallel_utils, with the
# parameters (and defaults) the reference documents.
REFERENCE = {
    "_get_dp_size_from_grid": ["grid"],
    "unwrap_megatron_mimo_model": ["model"],
    "is_current_rank_in_grid": ["grid"],
    "get_active_module_pg": ["megatron_mimo_infra"],
    "get_module_to_grid_tuple": ["megatron_mimo_model", "infra"],
    "build_pg_collection_for_schedule": ["infra"],
    "multimodule_no_sync": ["module_to_grid_tuple"],
    "finalize_model_grads_multimodule": [
        "model",
        "num_tokens",
        "pg_collection",
        "force_all_reduce",
        "infra",
        "module_to_grid_tuple",
    ],
    "zero_grad_buffer_for_multimodule": ["module_to_grid_tuple"],
    "validate_no_stub_ranks": ["module_to_grid_map", "world_size"],
    "validate_data_loader_contract": [
        "infra",
        "global_batch_size",
        "micro_batch_size",
        "num_microbatches",
    ],
}


def test_reference_functions_have_the_reference_signatures() -> None:
    for name, params in REFERENCE.items():
        # The reference's private helper is reachable but, being private, not exported.
        assert (name in mimo.__all__) is not name.startswith("_"), name
        signature = inspect.signature(getattr(mimo, name))
        assert list(signature.parameters) == params, name
    finalize = inspect.signature(mimo.finalize_model_grads_multimodule).parameters
    assert [finalize[p].default for p in ("num_tokens", "pg_collection", "force_all_reduce")] == [
        None,
        None,
        None,
    ]
    assert finalize["infra"].kind is inspect.Parameter.KEYWORD_ONLY
    assert finalize["module_to_grid_tuple"].kind is inspect.Parameter.KEYWORD_ONLY
    no_sync = inspect.signature(mimo.multimodule_no_sync).parameters
    assert no_sync["module_to_grid_tuple"].kind is inspect.Parameter.KEYWORD_ONLY


def test_infra_has_the_reference_fields() -> None:
    fields = set(inspect.signature(mimo.MegatronMIMOInfra).parameters)
    assert {"module_to_grid_map", "topology", "pg_collections", "participating_modules"} <= fields


def test_every_exported_name_resolves() -> None:
    missing = [name for name in mimo.__all__ if not hasattr(mimo, name)]
    assert not missing
