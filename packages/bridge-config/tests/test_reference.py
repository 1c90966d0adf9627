"""Every class, field, type and default of the reference exists as documented."""

# The table spells types the way the reference does (Optional[...], Union[...]).
# ruff: noqa: UP007, UP045

from __future__ import annotations

import dataclasses
import logging
import signal
import typing
from pathlib import Path
from typing import Any, Literal, Optional, Union

import pytest

import bridge.config as bc
from bridge.config import describe_fields

REQUIRED = object()  # no default: must be given
FACTORY = object()  # a default factory (checked separately)
DERIVED = object()  # init=False, filled in by the class or validate()

# (field, type, default) per class, transcribed from the reference.
REFERENCE: dict[type, list[tuple[str, Any, Any]]] = {
    bc.RNGConfig: [
        ("seed", int, 1234),
        ("te_rng_tracker", bool, False),
        ("inference_rng_tracker", bool, False),
        ("data_parallel_random_init", bool, False),
        # Beyond the reference (#24): the same initial weights under every layout.
        ("layout_independent_init", Optional[bool], None),
    ],
    bc.DistributedInitConfig: [
        ("distributed_backend", Literal["nccl", "gloo"], "nccl"),
        ("distributed_timeout_minutes", int, 10),
        ("align_grad_reduce", bool, True),
        ("local_rank", int, FACTORY),
        ("lazy_init", bool, False),
        ("use_torch_fsdp2", bool, False),
        ("nccl_communicator_config_path", Optional[str], None),
        ("use_tp_pp_dp_mapping", bool, False),
        ("use_gloo_process_groups", bool, True),
        ("use_sharp", bool, False),
        ("high_priority_stream_groups", Optional[list[str]], None),
        ("external_gpu_device_mapping", bool, False),
        ("enable_megatron_core_experimental", bool, False),
    ],
    bc.RerunStateMachineConfig: [
        ("error_injection_rate", int, 0),
        (
            "error_injection_type",
            Literal["correct_result", "transient_error", "persistent_error"],
            "transient_error",
        ),
        ("rerun_mode", Literal["disabled", "validate_results", "report_stats"], "disabled"),
    ],
    bc.DataloaderConfig: [
        ("dataloader_type", Optional[Literal["single", "cyclic", "external"]], None),
        ("num_workers", int, 8),
        ("data_sharding", bool, True),
        ("pin_memory", bool, True),
        ("persistent_workers", bool, False),
    ],
    bc.MockGPTDatasetConfig: [
        ("blend", type(None), DERIVED),
        ("blend_per_split", type(None), DERIVED),
    ],
    bc.FinetuningDatasetConfig: [
        ("dataset_root", Optional[Union[str, Path]], None),
        # The reference's `int = None`, spelt Optional like every other None default here;
        # validate() requires it (dataset.seq_length).
        ("seq_length", Optional[int], None),
        ("seed", int, 1234),
        ("memmap_workers", int, 1),
        ("max_train_samples", Optional[int], None),
        ("packed_sequence_specs", Optional[bc.PackedSequenceSpecs], None),
        ("dataset_kwargs", Optional[dict[str, Any]], None),
        ("do_validation", bool, True),
        ("do_test", bool, True),
    ],
    bc.SchedulerConfig: [
        (
            "lr_decay_style",
            Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"],
            "linear",
        ),
        ("lr_wsd_decay_style", Literal["exponential", "linear", "cosine"], "exponential"),
        ("lr_decay_iters", Optional[int], None),
        ("lr_wsd_decay_iters", Optional[int], None),
        ("lr_warmup_fraction", Optional[float], None),
        ("lr_warmup_iters", int, 0),
        ("lr_warmup_init", float, 0.0),
        ("override_opt_param_scheduler", bool, False),
        ("use_checkpoint_opt_param_scheduler", bool, False),
        ("start_weight_decay", Optional[float], None),
        ("end_weight_decay", Optional[float], None),
        ("weight_decay_incr_style", Literal["constant", "linear", "cosine"], "constant"),
        ("lr_warmup_steps", Optional[int], DERIVED),
        ("lr_decay_steps", Optional[int], DERIVED),
        ("wd_incr_steps", Optional[int], DERIVED),
        ("wsd_decay_steps", Optional[int], DERIVED),
    ],
    bc.TrainingConfig: [
        ("micro_batch_size", Optional[int], None),
        ("global_batch_size", Optional[int], None),
        ("rampup_batch_size", Optional[list[int]], None),
        ("decrease_batch_size_if_needed", bool, False),
        ("empty_unused_memory_level", Literal[0, 1, 2], 0),
        ("check_weight_hash_across_dp_replicas_interval", Optional[int], None),
        ("train_sync_interval", Optional[int], None),
        ("train_iters", Optional[int], None),
        ("exit_interval", Optional[int], None),
        ("exit_duration_in_mins", Optional[int], None),
        ("exit_signal_handler", bool, False),
        # The reference page renders this non-literal default as "None"; kept as SIGTERM
        # (see "Differences from the reference" in docs/configuration.md).
        ("exit_signal", int, signal.SIGTERM),
        ("exit_signal_handler_for_dataloader", bool, False),
        ("manual_gc", bool, False),
        ("manual_gc_interval", int, 0),
        ("manual_gc_eval", bool, True),
        ("eval_iters", int, 100),
        ("eval_interval", Optional[int], 1000),
        ("skip_train", bool, False),
        # Beyond the reference (lead's decisions).
        ("engine", Optional[Literal["portable", "megatron"]], None),  # deprecated alias
        ("train_samples", Optional[int], None),
    ],
    bc.CheckpointConfig: [
        ("save", Optional[str], None),
        ("save_interval", Optional[int], None),
        ("save_optim", bool, True),
        ("save_rng", bool, True),
        ("load", Optional[str], None),
        ("load_optim", bool, True),
        ("load_main_params_from_ckpt", bool, False),
        ("load_rng", bool, True),
        ("non_persistent_save_interval", Optional[int], None),
        (
            "non_persistent_ckpt_type",
            Optional[Literal["global", "local", "in_memory", None]],
            None,
        ),
        ("non_persistent_global_ckpt_dir", Optional[str], None),
        ("non_persistent_local_ckpt_dir", Optional[str], None),
        ("non_persistent_local_ckpt_algo", Literal["fully_parallel", "atomic"], "fully_parallel"),
        ("finetune", bool, False),
        ("pretrained_checkpoint", Optional[str], None),
        ("ckpt_step", Optional[int], None),
        ("use_checkpoint_args", bool, False),
        ("exit_on_missing_checkpoint", bool, False),
        ("ckpt_format", Literal["torch_dist", "zarr"], "torch_dist"),
        ("ckpt_convert_format", Optional[Literal["torch", "torch_dist", "zarr"]], None),
        ("ckpt_convert_save", Optional[str], None),
        ("fully_parallel_save", bool, True),
        ("async_save", bool, False),
        ("use_persistent_ckpt_worker", bool, True),
        ("fully_parallel_load", bool, False),
        ("ckpt_assume_constant_structure", bool, False),
        (
            "dist_ckpt_strictness",
            Literal[
                "assume_ok_unexpected",
                "log_unexpected",
                "log_all",
                "raise_unexpected",
                "raise_all",
                "return_unexpected",
                "return_all",
                "ignore_all",
            ],
            "assume_ok_unexpected",
        ),
        ("replication", bool, False),
        ("replication_jump", Optional[int], None),
        ("replication_factor", int, 2),
    ],
    bc.LoggerConfig: [
        ("log_interval", int, 100),
        ("log_params_norm", bool, False),
        ("log_throughput", bool, False),
        ("log_progress", bool, False),
        ("timing_log_level", Literal[0, 1, 2], 0),
        ("timing_log_option", Literal["max", "minmax", "all"], "minmax"),
        ("tensorboard_dir", Optional[str], None),
        ("tensorboard_log_interval", int, 1),
        ("tensorboard_queue_size", int, 1000),
        ("log_timers_to_tensorboard", bool, False),
        ("log_loss_scale_to_tensorboard", bool, True),
        ("log_validation_ppl_to_tensorboard", bool, False),
        ("log_memory_to_tensorboard", bool, False),
        ("log_world_size_to_tensorboard", bool, False),
        ("wandb_project", Optional[str], None),
        ("wandb_exp_name", Optional[str], None),
        ("wandb_save_dir", Optional[str], None),
        ("wandb_entity", Optional[str], None),
        # Rendered as "None" by the reference page; kept as logging.INFO (see "Differences
        # from the reference" in docs/configuration.md).
        ("logging_level", int, logging.INFO),
        ("filter_warnings", bool, True),
        ("modules_to_filter", Optional[list[str]], None),
        ("set_level_for_all_loggers", bool, False),
        ("log_energy", bool, False),
    ],
    bc.ProfilingConfig: [
        ("use_nsys_profiler", bool, False),
        ("profile_step_start", int, 10),
        ("profile_step_end", int, 12),
        ("use_pytorch_profiler", bool, False),
        ("profile_ranks", list[int], FACTORY),
        ("record_memory_history", bool, False),
        ("memory_snapshot_path", str, "snapshot.pickle"),
        ("record_shapes", bool, False),
    ],
    bc.FaultToleranceConfig: [
        ("enable_ft_package", bool, False),
        ("calc_ft_timeouts", bool, False),
        ("simulate_fault", bool, False),
        ("simulated_fault_type", Literal["rank_hung", "rank_killed", "random"], "random"),
        ("simulated_fault_rank", Optional[int], None),
        ("simulated_fault_base_delay", int, 0),
    ],
    bc.StragglerDetectionConfig: [
        ("log_straggler", bool, False),
        ("enable_straggler_on_startup", bool, True),
        ("straggler_ctrlr_port", int, 65535),
        ("straggler_minmax_count", int, 1),
        ("disable_straggler_on_startup", bool, False),
    ],
    bc.NVRxStragglerDetectionConfig: [
        ("enabled", bool, False),
        ("report_time_interval", float, 300.0),
        ("calc_relative_gpu_perf", bool, True),
        ("calc_individual_gpu_perf", bool, True),
        ("num_gpu_perf_scores_to_print", int, 5),
        ("gpu_relative_perf_threshold", float, 0.7),
        ("gpu_individual_perf_threshold", float, 0.7),
        ("stop_if_detected", bool, False),
        ("enable_logging", bool, True),
        ("profiling_interval", int, 1),
        ("logger_name", str, "megatron_hub.NVRxStragglerDetection"),
    ],
    bc.ConfigContainer: [
        ("rng", bc.RNGConfig, FACTORY),
        ("rerun_state_machine", bc.RerunStateMachineConfig, FACTORY),
        ("train", Optional[bc.TrainingConfig], None),
        ("model", Optional[bc.ModelConfigProtocol], None),
        ("optimizer", Optional[bc.OptimizerConfigProtocol], None),
        ("ddp", bc.DDPConfigProtocol, FACTORY),
        ("scheduler", Optional[bc.SchedulerConfig], None),
        ("dataset", Optional[Union[bc.GPTDatasetConfig, bc.FinetuningDatasetConfig]], None),
        ("logger", Optional[bc.LoggerConfig], None),
        # The reference's TokenizerConfig, or any object with its fields.
        ("tokenizer", Optional[Union[bc.TokenizerConfig, bc.TokenizerConfigProtocol]], None),
        ("checkpoint", Optional[bc.CheckpointConfig], None),
        ("dist", bc.DistributedInitConfig, FACTORY),
        ("ft", Optional[bc.FaultToleranceConfig], None),
        ("straggler", Optional[bc.StragglerDetectionConfig], None),
        ("nvrx_straggler", Optional[bc.NVRxStragglerDetectionConfig], None),
        ("profiling", Optional[bc.ProfilingConfig], None),
        ("peft", Optional[bc.PEFTProtocol], None),
        ("comm_overlap", Optional[bc.CommOverlapConfigProtocol], None),
        ("mixed_precision", Optional[Union[bc.MixedPrecisionConfigProtocol, str]], None),
    ],
}

CASES = [(cls, *row) for cls, rows in REFERENCE.items() for row in rows]


@pytest.mark.parametrize(
    ("cls", "name", "expected_type", "default"),
    CASES,
    ids=[f"{c.__name__}.{n}" for c, n, _, _ in CASES],
)
def test_field_type_and_default(cls: type, name: str, expected_type: Any, default: Any) -> None:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert name in fields, f"{cls.__name__} lacks {name}"
    f = fields[name]
    assert typing.get_type_hints(cls)[name] == expected_type
    if default is REQUIRED:
        assert f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    elif default is FACTORY:
        assert f.default_factory is not dataclasses.MISSING
    elif default is DERIVED:
        assert not f.init and f.default is None
    else:
        assert f.default == default and type(f.default) is type(default)


def test_factory_defaults() -> None:
    assert bc.ProfilingConfig().profile_ranks == [0]
    container = bc.ConfigContainer()
    assert container.rng == bc.RNGConfig()
    assert container.rerun_state_machine == bc.RerunStateMachineConfig()
    assert container.dist == bc.DistributedInitConfig()
    assert isinstance(container.ddp, bc.DistributedDataParallelConfig)
    assert (
        container.train is None and container.model is None and container.data_parallel_size is None
    )


def test_local_rank_comes_from_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's ``LOCAL_RANK``, else (a task srun started, before bridge-train exports
    ``LOCAL_RANK``) ``SLURM_LOCALID``, else 0."""
    monkeypatch.delenv("SLURM_LOCALID", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert bc.DistributedInitConfig().local_rank == 3
    monkeypatch.setenv("SLURM_LOCALID", "1")  # srun starting torchrun: torchrun's rank
    assert bc.DistributedInitConfig().local_rank == 3
    monkeypatch.delenv("LOCAL_RANK")
    assert bc.DistributedInitConfig().local_rank == 1
    monkeypatch.setenv("SLURM_LOCALID", "first")
    with pytest.raises(
        bc.ConfigError, match=r"SLURM_LOCALID environment variable must be an integer"
    ) as info:
        bc.DistributedInitConfig()
    assert info.value.location == "DistributedInitConfig.local_rank"
    monkeypatch.delenv("SLURM_LOCALID")
    assert bc.DistributedInitConfig().local_rank == 0


def test_a_saved_config_leaves_the_launchers_local_rank_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0 saves the run's config and every rank loads it: the launcher's local rank is
    not saved (each loading process takes its own); a value set to another one is."""
    monkeypatch.delenv("SLURM_LOCALID", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    saved = bc.ConfigContainer().to_dict()
    assert "local_rank" not in saved["dist"]
    monkeypatch.setenv("LOCAL_RANK", "1")  # another rank loads it
    assert bc.ConfigContainer.from_dict(saved).dist.local_rank == 1
    pinned = bc.ConfigContainer(dist=bc.DistributedInitConfig(local_rank=2)).to_dict()
    assert pinned["dist"]["local_rank"] == 2
    assert bc.ConfigContainer.from_dict(pinned).dist.local_rank == 2
    assert "local_rank: 1" in bc.ConfigContainer().format_yaml()  # printed, not saved


def test_gpt_dataset_config_is_a_dataloader_config_and_mock_is_a_gpt_config() -> None:
    assert issubclass(bc.GPTDatasetConfig, bc.DataloaderConfig)
    assert issubclass(bc.FinetuningDatasetConfig, bc.DataloaderConfig)
    assert issubclass(bc.MockGPTDatasetConfig, bc.GPTDatasetConfig)
    init_names = {f.name for f in dataclasses.fields(bc.MockGPTDatasetConfig) if f.init}
    assert "blend" not in init_names and "blend_per_split" not in init_names


def test_tokenizer_config_fields() -> None:
    names = {f.name for f in dataclasses.fields(bc.TokenizerConfig)}
    assert {
        "tokenizer_type",
        "tokenizer_model",
        "vocab_size",
        "vocab_extra_ids",
        "make_vocab_size_divisible_by",
    } <= names
    options = typing.get_args(
        typing.get_args(typing.get_type_hints(bc.TokenizerConfig)["tokenizer_type"])[0]
    )
    assert {"NullTokenizer", "ByteLevelTokenizer", "HuggingFaceTokenizer"} <= set(options)


SECTIONS = [
    bc.RNGConfig,
    bc.DistributedInitConfig,
    bc.RerunStateMachineConfig,
    bc.DataloaderConfig,
    bc.GPTDatasetConfig,
    bc.MockGPTDatasetConfig,
    bc.FinetuningDatasetConfig,
    bc.PackedSequenceSpecs,
    bc.SchedulerConfig,
    bc.TrainingConfig,
    bc.CheckpointConfig,
    bc.LoggerConfig,
    bc.ProfilingConfig,
    bc.FaultToleranceConfig,
    bc.StragglerDetectionConfig,
    bc.NVRxStragglerDetectionConfig,
    bc.TokenizerConfig,
    bc.DistributedDataParallelConfig,
    bc.ConfigContainer,
]


@pytest.mark.parametrize("cls", SECTIONS, ids=lambda c: c.__name__)
def test_every_field_and_class_is_documented(cls: type) -> None:
    assert cls.__doc__ and cls.__doc__.strip()
    undocumented = [info.name for info in describe_fields(cls) if len(info.doc) < 10]
    assert not undocumented, f"{cls.__name__}: fields without a docstring: {undocumented}"


def test_public_api_is_exported() -> None:
    for name in bc.__all__:
        assert getattr(bc, name) is not None
    for cls in SECTIONS:
        assert cls.__name__ in bc.__all__
