"""bridge.train exports every reference name it owns, and only from modules that exist."""

from __future__ import annotations

import bridge.train as bt

# Reference 000 names that live in bridge.train (the metric/report functions come from
# bridge.logging and are re-exported by the loop helper).
REFERENCE_000 = [
    "LinearForLastLayer",
    "create_value_head_hook",
    "make_value_model",
    "freeze_moe_router",
    "param_is_not_shared",
    "calc_params_l2_norm",
    "calc_dtensor_params_l2_norm",
    "reduce_max_stat_across_model_parallel_group",
    "logical_and_across_model_parallel_group",
    "prepare_forward_step_func",
    "needs_global_state_injection",
    "maybe_inject_state",
    "ModelList",
    "ModelHook",
]

ENGINE_AND_DATA = [
    "GPTModelProvider",
    "GlobalState",
    "TrainState",
    "Engine",
    "PortableEngine",
    "MegatronEngine",
    "build_engine",
    "initialize_distributed",
    "forward_step",
    "num_floating_point_operations",
    "build_tokenizer",
    "preprocess_data",
    "build_train_valid_test_datasets",
    "build_train_valid_test_data_iterators",
]


def test_reference_and_engine_names_are_exported() -> None:
    for name in REFERENCE_000 + ENGINE_AND_DATA:
        assert name in bt.__all__, name
        assert getattr(bt, name) is not None


def test_all_lists_only_existing_names_without_duplicates() -> None:
    assert len(set(bt.__all__)) == len(bt.__all__)
    missing = [name for name in bt.__all__ if not hasattr(bt, name)]
    assert not missing
