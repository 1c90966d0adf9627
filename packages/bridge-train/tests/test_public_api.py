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
    "logger",
]

# The few names a user of the trainer needs beyond the reference (docs/architecture.md,
# "Public API" says why each one is here).
USER_ENTRY_POINTS = [
    "GlobalState",
    "TrainState",
    "ForwardStepCallable",
    "TNvtxContext",
    "GPTModelProvider",
    "T5ModelProvider",
    "MambaProvider",
    "forward_step",
    "t5_forward_step",
    "LoRA",
    "Callback",
    "CallbackError",
    "LoopContext",
    "StepResult",
]

# Names that left bridge.train's namespace: each stays importable from its own module.
OWN_MODULE_ONLY = {
    "bridge.train.engine": ["Engine", "MegatronEngine", "build_engine"],
    "bridge.train.engine.initialize": ["initialize_distributed"],
    "bridge.train.metrics.flops": ["num_floating_point_operations"],
    "bridge.train.data": [
        "build_tokenizer",
        "preprocess_data",
        "build_train_valid_test_datasets",
        "build_train_valid_test_data_iterators",
    ],
    "bridge.train.checkpointing": ["save_checkpoint", "load_checkpoint", "CheckpointError"],
    "bridge.train.loop.bare_loop": ["run_bare_loop", "train_steps"],
    "bridge.logging": ["_MoeMetricFanoutWriter", "_build_moe_metric_writer"],
}


def test_reference_and_user_names_are_exported() -> None:
    for name in REFERENCE_000 + USER_ENTRY_POINTS:
        assert name in bt.__all__, name
        assert getattr(bt, name) is not None


def test_other_names_live_only_in_their_own_modules() -> None:
    import importlib

    for module, names in OWN_MODULE_ONLY.items():
        for name in names:
            assert getattr(importlib.import_module(module), name) is not None
            assert name not in bt.__all__, name
            assert not hasattr(bt, name), name


def test_exports_are_exactly_the_reference_and_user_names() -> None:
    documented = set(REFERENCE_000 + REFERENCE_001 + REFERENCE_000_LOGGING + TRAINER)
    assert set(bt.__all__) == documented | set(USER_ENTRY_POINTS)


def test_lazy_table_type_checking_block_and_all_agree() -> None:
    """The export table, the TYPE_CHECKING imports and ``__all__`` name the same things."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(bt))
    guarded = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    )
    type_checked = {
        alias.name: node.module
        for node in guarded.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert type_checked == bt._MODULE_OF
    assert set(bt.__all__) == set(bt._MODULE_OF) | {"logger"}


def test_logger_is_the_parent_of_every_trainer_module_logger() -> None:
    import logging

    assert bt.logger is logging.getLogger("bridge.train")
    assert logging.getLogger("bridge.train.loop.training").parent is bt.logger


def test_all_lists_only_existing_names_without_duplicates() -> None:
    assert len(set(bt.__all__)) == len(bt.__all__)
    missing = [name for name in bt.__all__ if not hasattr(bt, name)]
    assert not missing


# Reference 001 (the loop) and the metric/report functions of reference 000 that
# bridge.logging implements and bridge.train re-exports.
REFERENCE_001 = [
    "train",
    "train_step",
    "post_training_step_callbacks",
    "should_disable_forward_pre_hook",
    "enable_forward_pre_hook",
    "disable_forward_pre_hook",
    "get_start_time_from_progress_log",
    "compute_throughputs_and_append_to_progress_log",
    "save_checkpoint_and_time",
    "checkpoint_and_decide_exit",
]
REFERENCE_000_LOGGING = [
    "training_log",
    "report_memory",
    "report_l2_norm_grad",
    "report_runtime",
    "report_throughput",
    "reduce_max_memory_across_pp_group",
    "start_memory_history_recording",
    "MEMORY_KEYS",
]
TRAINER = ["pretrain", "setup", "evaluate", "evaluate_and_print_results", "GlobalState"]


def test_loop_and_logging_names_are_exported() -> None:
    import inspect

    import bridge.logging as bl

    for name in REFERENCE_001 + REFERENCE_000_LOGGING + TRAINER:
        assert name in bt.__all__, name
    for name in REFERENCE_000_LOGGING:
        assert getattr(bt, name) is getattr(bl, name), name
    params = list(inspect.signature(bt.train).parameters)
    assert params == [
        "forward_step_func",
        "model",
        "optimizer",
        "scheduler",
        "train_data_iterator",
        "valid_data_iterator",
        "global_state",
        "checkpointing_context",
        "process_non_loss_data_func",
        "non_loss_data_func",
    ]
    callbacks = inspect.signature(bt.post_training_step_callbacks).parameters
    assert list(callbacks)[:8] == [
        "model",
        "num_floating_point_operations_since_last_log_event",
        "straggler_timer",
        "iteration",
        "prof",
        "config",
        "should_toggle_forward_pre_hook",
        "nsys_nvtx_context",
    ]
    assert inspect.signature(bt.disable_forward_pre_hook).parameters["param_sync"].default is True
    save = inspect.signature(bt.save_checkpoint_and_time).parameters
    assert (
        save["non_persistent_ckpt"].default is False and save["train_data_iterator"].default is None
    )
