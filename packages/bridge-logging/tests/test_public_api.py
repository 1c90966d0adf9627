"""bridge.logging exports the reference's logging names with the reference's signatures."""

from __future__ import annotations

import inspect

import bridge.logging as bl

# Logging / report names of reference 000 (re-exported by bridge.train) and the
# trainer contract.
REFERENCE_000 = [
    "MEMORY_KEYS",
    "start_memory_history_recording",
    "reduce_max_memory_across_pp_group",
    "training_log",
    "report_memory",
    "report_l2_norm_grad",
    "report_runtime",
    "report_throughput",
]
CONTRACT = [
    "TrainProgress",
    "LoggingState",
    "MetricWriter",
    "MetricWriters",
    "build_metric_writers",
    "setup_logging",
    "log_validation_results",
    "ProgressReporter",
    "BackendSettings",
    "ReportSettings",
]


def test_names_are_exported_once() -> None:
    for name in REFERENCE_000 + CONTRACT:
        assert name in bl.__all__, name
        assert getattr(bl, name) is not None
    assert len(set(bl.__all__)) == len(bl.__all__)
    assert not [name for name in bl.__all__ if not hasattr(bl, name)]


def test_reference_private_spellings_are_reachable_but_not_exported() -> None:
    """The reference's ``_``-names stay importable, as the public writer they alias."""
    assert bl._MoeMetricFanoutWriter is bl.MoeMetricFanoutWriter
    assert bl._build_moe_metric_writer is bl.build_moe_metric_writer
    assert not [name for name in bl.__all__ if name.startswith("_")]


def test_reference_signatures() -> None:
    params = inspect.signature(bl.training_log).parameters
    assert list(params) == [
        "loss_dict",
        "total_loss_dict",
        "learning_rate",
        "decoupled_learning_rate",
        "loss_scale",
        "report_memory_flag",
        "skipped_iter",
        "grad_norm",
        "params_norm",
        "num_zeros_in_grad",
        "config",
        "global_state",
        "history_wct",
        "model",
        "pg_collection",
        "log_max_attention_logit",
        "loaded_iteration",
        "seq_length",
    ]
    assert params["pg_collection"].default is None
    assert params["loaded_iteration"].default == 0
    throughput = inspect.signature(bl.report_throughput).parameters
    assert [p.name for p in throughput.values() if p.kind is p.POSITIONAL_OR_KEYWORD] == [
        "train_config",
        "iteration",
        "seq_length",
        "history_wct",
        "window_size",
    ]
    # The extension is keyword-only with a default, so reference calls are unaffected.
    assert throughput["samples_in_window"].kind is inspect.Parameter.KEYWORD_ONLY
    assert throughput["samples_in_window"].default is None
    grad_norm = inspect.signature(bl.report_l2_norm_grad).parameters
    assert next(iter(grad_norm)) == "model"
    assert all(p.kind is p.KEYWORD_ONLY and p.default is None for p in list(grad_norm.values())[1:])
    runtime = inspect.signature(bl.report_runtime).parameters
    assert list(runtime)[:5] == [
        "train_state",
        "start_time",
        "seq_length",
        "train_iters",
        "time_unit",
    ]
    assert runtime["time_unit"].default == "seconds"
    assert list(inspect.signature(bl._build_moe_metric_writer).parameters) == [
        "tb_writer",
        "comet_logger",
        "mlflow_logger",
    ]
    assert inspect.signature(bl.report_memory).parameters["memory_keys"].default is None
    build = inspect.signature(bl.build_metric_writers).parameters
    assert [p.name for p in build.values() if p.kind is p.KEYWORD_ONLY][:4] == [
        "rank",
        "world_size",
        "run_config",
        "backend_settings",
    ]
