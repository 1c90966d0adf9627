"""Bad input of every kind raises ConfigError naming the place, the value and the fix."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import bridge.config as bc
from bridge.config import ConfigContainer, ConfigError, apply_overrides, load_config
from bridge.config.testing import (
    ExampleCommOverlapConfig,
    ExampleModelConfig,
    ExampleOptimizerConfig,
    tiny_container,
)

GPT_FLAGS: dict[str, Any] = {
    "reset_position_ids": False,
    "reset_attention_mask": False,
    "eod_mask_loss": False,
}


def gpt(**kwargs: Any) -> bc.GPTDatasetConfig:
    values: dict[str, Any] = {"random_seed": 1, "sequence_length": 32, **GPT_FLAGS}
    values.update(kwargs)
    return bc.GPTDatasetConfig(**values)


class IdentityPEFT:
    """A parameter-efficient finetuning transform that leaves the model as it is."""

    def __call__(self, model: Any, training: bool = True) -> Any:
        return model


def validate(world_size: int = 1, **sections: Any) -> Callable[[], None]:
    return lambda: tiny_container(**sections).validate(world_size=world_size)


@dataclasses.dataclass(kw_only=True)
class MoEModelConfig(ExampleModelConfig):
    """A mixture-of-experts model: megatron's expert fields next to the protocol's."""

    num_moe_experts: int | None = None
    expert_tensor_parallel_size: int | None = None


def moe(**kwargs: Any) -> MoEModelConfig:
    return MoEModelConfig(**kwargs)


# Each case: a call that must fail, and substrings its message must contain.
SECTION_CASES: list[tuple[str, Callable[[], Any], list[str]]] = [
    (
        "train-mbs-zero",
        lambda: bc.TrainingConfig(micro_batch_size=0),
        ["TrainingConfig.micro_batch_size: got 0", "positive integer"],
    ),
    (
        "train-iters-and-samples",
        lambda: bc.TrainingConfig(train_iters=10, train_samples=100),
        ["train_iters and train_samples are mutually exclusive", "set only one"],
    ),
    (
        "train-rampup-shape",
        lambda: bc.TrainingConfig(rampup_batch_size=[16, 8]),
        ["TrainingConfig.rampup_batch_size: got [16, 8]", "three positive integers"],
    ),
    (
        "train-exit-signal",
        lambda: bc.TrainingConfig(exit_signal=999),
        ["TrainingConfig.exit_signal: got 999", "signal number"],
    ),
    (
        "train-engine-literal",
        lambda: bc.TrainingConfig(engine="fast"),  # type: ignore[arg-type]
        ["TrainingConfig.engine: got 'fast'", "expected one of 'portable', 'megatron'"],
    ),
    (
        "train-mbs-string",
        lambda: bc.TrainingConfig(micro_batch_size="4"),  # type: ignore[arg-type]
        ["TrainingConfig.micro_batch_size: got '4' (str); expected an integer"],
    ),
    (
        "train-bool-as-int",
        lambda: bc.TrainingConfig(train_iters=True),
        ["TrainingConfig.train_iters: got True (bool); expected an integer"],
    ),
    (
        "sched-warmup-exclusive",
        lambda: bc.SchedulerConfig(lr_warmup_fraction=0.1, lr_warmup_iters=10),
        ["SchedulerConfig: lr_warmup_fraction and lr_warmup_iters are mutually exclusive"],
    ),
    (
        "sched-wsd-needs-iters",
        lambda: bc.SchedulerConfig(lr_decay_style="WSD"),
        ["SchedulerConfig.lr_wsd_decay_iters: got None", "'WSD' needs"],
    ),
    (
        "sched-wd-incr-needs-values",
        lambda: bc.SchedulerConfig(weight_decay_incr_style="linear"),
        [
            "SchedulerConfig.start_weight_decay",
            "'linear' needs start_weight_decay and end_weight_decay",
        ],
    ),
    (
        "sched-wd-decreasing",
        lambda: bc.SchedulerConfig(
            start_weight_decay=0.1, end_weight_decay=0.01, weight_decay_incr_style="linear"
        ),
        ["end_weight_decay (0.01) is below start_weight_decay (0.1)"],
    ),
    (
        "sched-wd-half-set",
        lambda: bc.SchedulerConfig(start_weight_decay=0.1),
        [
            "SchedulerConfig.end_weight_decay",
            "set start_weight_decay and end_weight_decay together",
        ],
    ),
    (
        "sched-wd-constant-differs",
        lambda: bc.SchedulerConfig(start_weight_decay=0.1, end_weight_decay=0.2),
        ["differ but weight_decay_incr_style is 'constant'"],
    ),
    (
        "sched-fraction-range",
        lambda: bc.SchedulerConfig(lr_warmup_fraction=1.5),
        ["SchedulerConfig.lr_warmup_fraction: got 1.5", "[0.0, 1.0]"],
    ),
    (
        "sched-override-vs-checkpoint",
        lambda: bc.SchedulerConfig(
            override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=True
        ),
        [
            "override_opt_param_scheduler and use_checkpoint_opt_param_scheduler are mutually exclusive"
        ],
    ),
    (
        "sched-mix-iters-samples",
        lambda: bc.SchedulerConfig(lr_decay_iters=10, lr_warmup_samples=5),
        [
            "iteration-based (lr_decay_iters) and sample-based (lr_warmup_samples) settings cannot be mixed"
        ],
    ),
    (
        "sched-style-typo",
        lambda: bc.SchedulerConfig(lr_decay_style="cosnie"),  # type: ignore[arg-type]
        ["SchedulerConfig.lr_decay_style: got 'cosnie'", "Did you mean 'cosine'?"],
    ),
    (
        "ckpt-async-format",
        lambda: bc.CheckpointConfig(async_save=True, save="/x", ckpt_format="zarr"),
        ["CheckpointConfig.async_save", "only with ckpt_format 'torch_dist', not 'zarr'"],
    ),
    (
        "ckpt-async-needs-save",
        lambda: bc.CheckpointConfig(async_save=True),
        ["CheckpointConfig.async_save", "needs save"],
    ),
    (
        "ckpt-global-needs-dir",
        lambda: bc.CheckpointConfig(non_persistent_ckpt_type="global"),
        ["CheckpointConfig.non_persistent_global_ckpt_dir", "needs this directory or save"],
    ),
    (
        "ckpt-local-needs-dir",
        lambda: bc.CheckpointConfig(non_persistent_ckpt_type="local"),
        ["CheckpointConfig.non_persistent_local_ckpt_dir", "'local' needs this directory"],
    ),
    (
        "ckpt-interval-needs-type",
        lambda: bc.CheckpointConfig(non_persistent_save_interval=5),
        ["CheckpointConfig.non_persistent_save_interval: got 5", "needs non_persistent_ckpt_type"],
    ),
    (
        "ckpt-main-params",
        lambda: bc.CheckpointConfig(load_main_params_from_ckpt=True),
        ["load_main_params_from_ckpt needs load_optim=False"],
    ),
    (
        "ckpt-finetune-source",
        lambda: bc.CheckpointConfig(finetune=True),
        ["CheckpointConfig.finetune", "set load or pretrained_checkpoint"],
    ),
    (
        "ckpt-replication-local",
        lambda: bc.CheckpointConfig(replication=True),
        ["CheckpointConfig.replication", "non_persistent_ckpt_type='local'"],
    ),
    (
        "prof-step-order",
        lambda: bc.ProfilingConfig(profile_step_start=5, profile_step_end=5),
        ["ProfilingConfig.profile_step_end: got 5", "greater than profile_step_start (5)"],
    ),
    (
        "prof-two-profilers",
        lambda: bc.ProfilingConfig(use_nsys_profiler=True, use_pytorch_profiler=True),
        ["use_nsys_profiler and use_pytorch_profiler are mutually exclusive"],
    ),
    (
        "prof-negative-rank",
        lambda: bc.ProfilingConfig(profile_ranks=[0, -1]),
        ["ProfilingConfig.profile_ranks: got [0, -1]", "non-negative"],
    ),
    (
        "nvrx-threshold-zero",
        lambda: bc.NVRxStragglerDetectionConfig(gpu_relative_perf_threshold=0.0),
        ["gpu_relative_perf_threshold: got 0.0", "(0.0, 1.0]"],
    ),
    (
        "nvrx-threshold-above-one",
        lambda: bc.NVRxStragglerDetectionConfig(gpu_individual_perf_threshold=1.5),
        ["gpu_individual_perf_threshold: got 1.5", "(0.0, 1.0]"],
    ),
    (
        "nvrx-interval",
        lambda: bc.NVRxStragglerDetectionConfig(report_time_interval=0),
        ["report_time_interval: got 0", "> 0.0"],
    ),
    (
        "nvrx-profiling-interval",
        lambda: bc.NVRxStragglerDetectionConfig(profiling_interval=0),
        ["profiling_interval: got 0", "positive integer"],
    ),
    (
        "nvrx-scores",
        lambda: bc.NVRxStragglerDetectionConfig(num_gpu_perf_scores_to_print=-1),
        ["num_gpu_perf_scores_to_print: got -1", ">= 0"],
    ),
    (
        "nvrx-no-score",
        lambda: bc.NVRxStragglerDetectionConfig(
            enabled=True, calc_relative_gpu_perf=False, calc_individual_gpu_perf=False
        ),
        ["needs calc_relative_gpu_perf or calc_individual_gpu_perf"],
    ),
    (
        "ft-rank",
        lambda: bc.FaultToleranceConfig(simulated_fault_rank=-1),
        ["FaultToleranceConfig.simulated_fault_rank: got -1", ">= 0"],
    ),
    (
        "ft-delay",
        lambda: bc.FaultToleranceConfig(simulated_fault_base_delay=-5),
        ["simulated_fault_base_delay: got -5"],
    ),
    (
        "ft-fault-type",
        lambda: bc.FaultToleranceConfig(simulated_fault_type="rank_hang"),  # type: ignore[arg-type]
        ["simulated_fault_type: got 'rank_hang'", "Did you mean 'rank_hung'?"],
    ),
    (
        "straggler-port",
        lambda: bc.StragglerDetectionConfig(straggler_ctrlr_port=70000),
        ["straggler_ctrlr_port: got 70000", "[1, 65535]"],
    ),
    (
        "straggler-count",
        lambda: bc.StragglerDetectionConfig(straggler_minmax_count=0),
        ["straggler_minmax_count: got 0", "positive integer"],
    ),
    ("rng-seed", lambda: bc.RNGConfig(seed=-1), ["RNGConfig.seed: got -1", "[0, 4294967295]"]),
    (
        "dist-backend",
        lambda: bc.DistributedInitConfig(distributed_backend="mpi"),  # type: ignore[arg-type]
        ["distributed_backend: got 'mpi'", "'nccl', 'gloo'"],
    ),
    (
        "dist-timeout",
        lambda: bc.DistributedInitConfig(distributed_timeout_minutes=0),
        ["distributed_timeout_minutes: got 0"],
    ),
    (
        "rerun-rate",
        lambda: bc.RerunStateMachineConfig(error_injection_rate=-1),
        ["error_injection_rate: got -1"],
    ),
    (
        "data-blend-and-per-split",
        lambda: gpt(blend=(["a"], None), blend_per_split=[(["a"], None), None, None]),
        ["blend and blend_per_split are mutually exclusive"],
    ),
    (
        "data-blend-needs-split",
        lambda: gpt(blend=(["a"], None)),
        ["GPTDatasetConfig.split: got None", "required with blend, e.g. '99,1,0'"],
    ),
    (
        "data-split-format",
        lambda: gpt(blend=(["a"], None), split="99;1"),
        ["GPTDatasetConfig.split: got '99;1'", "1 to 3 non-negative numbers"],
    ),
    (
        "data-split-zero",
        lambda: gpt(blend=(["a"], None), split="0,0,0"),
        ["split weights sum to 0"],
    ),
    (
        "data-mock-and-blend",
        lambda: gpt(mock=True, blend=(["a"], None), split="1"),
        ["mock and blend are mutually exclusive"],
    ),
    (
        "data-flag-required",
        lambda: gpt(reset_position_ids=None),
        ["GPTDatasetConfig.reset_position_ids: got None", "set it to true or false"],
    ),
    (
        "data-blend-weights",
        lambda: gpt(blend=(["a", "b"], [1.0]), split="1"),
        ["GPTDatasetConfig.blend", "2 paths but 1 weights"],
    ),
    (
        "data-per-split-length",
        lambda: gpt(blend_per_split=[(["a"], None), None]),
        ["GPTDatasetConfig.blend_per_split", "expected 3 entries (train, validation, test)"],
    ),
    (
        "data-blend-shape",
        lambda: gpt(blend=["a", "b", "c"]),
        ["GPTDatasetConfig.blend: got ['a', 'b', 'c'] with 3 items; expected 2"],
    ),
    (
        "data-fast-cache",
        lambda: gpt(fast_cache_load=True),
        ["GPTDatasetConfig.fast_cache_load", "needs path_to_cache"],
    ),
    (
        "mock-false",
        lambda: bc.MockGPTDatasetConfig(random_seed=1, sequence_length=8, mock=False, **GPT_FLAGS),
        ["MockGPTDatasetConfig.mock: got False", "always uses mock data"],
    ),
    (
        "loader-persistent",
        lambda: bc.DataloaderConfig(persistent_workers=True, num_workers=0),
        ["DataloaderConfig.persistent_workers", "needs num_workers > 0"],
    ),
    (
        "tok-null-vocab",
        lambda: bc.TokenizerConfig(tokenizer_type="NullTokenizer"),
        ["TokenizerConfig.vocab_size: got None", "required when tokenizer_type is 'NullTokenizer'"],
    ),
    (
        "tok-hf-model",
        lambda: bc.TokenizerConfig(tokenizer_type="HuggingFaceTokenizer"),
        ["TokenizerConfig.tokenizer_model", "'HuggingFaceTokenizer'"],
    ),
    (
        "tok-byte-vocab",
        lambda: bc.TokenizerConfig(tokenizer_type="ByteLevelTokenizer", vocab_size=100),
        ["at least 258 ids (256 bytes, 2 special tokens"],
    ),
    (
        "tok-type-typo",
        lambda: bc.TokenizerConfig(tokenizer_type="NullTokeniser"),  # type: ignore[arg-type]
        ["Did you mean 'NullTokenizer'?"],
    ),
    (
        "ddp-param-gather",
        lambda: bc.DistributedDataParallelConfig(overlap_param_gather=True),
        ["overlap_param_gather", "needs use_distributed_optimizer=True"],
    ),
    (
        "ddp-buckets",
        lambda: bc.DistributedDataParallelConfig(bucket_size=10, num_buckets=2),
        ["bucket_size and num_buckets are mutually exclusive"],
    ),
    (
        "finetune-seq",
        lambda: bc.FinetuningDatasetConfig(seq_length=0),
        ["FinetuningDatasetConfig.seq_length: got 0"],
    ),
    (
        "packed-size",
        lambda: bc.PackedSequenceSpecs(packed_sequence_size=-2),
        ["PackedSequenceSpecs.packed_sequence_size: got -2"],
    ),
    (
        "sched-zero-fraction-with-iters",
        lambda: bc.SchedulerConfig(lr_warmup_fraction=0.0, lr_warmup_iters=5),
        [
            "SchedulerConfig: lr_warmup_fraction and lr_warmup_iters are mutually exclusive",
            "lr_warmup_fraction=0.0, lr_warmup_iters=5",
        ],
    ),
    (
        "sched-zero-fraction-with-samples",
        lambda: bc.SchedulerConfig(lr_warmup_fraction=0.0, lr_warmup_samples=50),
        ["lr_warmup_fraction and lr_warmup_samples are mutually exclusive"],
    ),
    (
        "sched-iters-and-samples-warmup",
        lambda: bc.SchedulerConfig(lr_warmup_iters=5, lr_warmup_samples=50),
        ["lr_warmup_iters and lr_warmup_samples are mutually exclusive"],
    ),
    (
        "nvrx-interval-nan",
        lambda: bc.NVRxStragglerDetectionConfig(report_time_interval=math.nan),
        ["NVRxStragglerDetectionConfig.report_time_interval: got nan", "finite number"],
    ),
    (
        "nvrx-interval-inf",
        lambda: bc.NVRxStragglerDetectionConfig(report_time_interval=math.inf),
        ["NVRxStragglerDetectionConfig.report_time_interval: got inf", "finite number"],
    ),
    (
        "nvrx-threshold-nan",
        lambda: bc.NVRxStragglerDetectionConfig(gpu_relative_perf_threshold=math.nan),
        ["NVRxStragglerDetectionConfig.gpu_relative_perf_threshold: got nan"],
    ),
    (
        "sched-warmup-init-nan",
        lambda: bc.SchedulerConfig(lr_warmup_init=math.nan),
        ["SchedulerConfig.lr_warmup_init: got nan", "finite number"],
    ),
    (
        "sched-warmup-fraction-nan",
        lambda: bc.SchedulerConfig(lr_warmup_fraction=math.nan),
        ["SchedulerConfig.lr_warmup_fraction: got nan"],
    ),
    (
        "sched-start-wd-nan",
        lambda: bc.SchedulerConfig(start_weight_decay=math.nan, end_weight_decay=0.1),
        ["SchedulerConfig.start_weight_decay: got nan", "finite number"],
    ),
    (
        "sched-end-wd-inf",
        lambda: bc.SchedulerConfig(
            start_weight_decay=0.0, end_weight_decay=math.inf, weight_decay_incr_style="linear"
        ),
        ["SchedulerConfig.end_weight_decay: got inf", "finite number"],
    ),
    (
        "data-surplus-inf",
        lambda: gpt(mid_level_dataset_surplus=-math.inf),
        ["GPTDatasetConfig.mid_level_dataset_surplus: got -inf", "finite number"],
    ),
    (
        "data-blend-weight-nan",
        lambda: gpt(blend=(["a", "b"], [1.0, math.nan]), split="1"),
        ["GPTDatasetConfig.blend[1][1]: got nan", "finite number"],
    ),
    (
        "ckpt-none-string",
        lambda: bc.CheckpointConfig(non_persistent_ckpt_type="None"),  # type: ignore[arg-type]
        [
            "CheckpointConfig.non_persistent_ckpt_type: got 'None'",
            "write null in YAML (None in Python)",
        ],
    ),
    (
        "kwarg-unknown",
        lambda: bc.TrainingConfig(train_iter=1),  # type: ignore[call-arg]
        [
            "TrainingConfig.train_iter: unknown field of TrainingConfig.",
            "Did you mean 'train_iters'?",
        ],
    ),
    (
        "kwarg-unknown-section",
        lambda: ConfigContainer(foo=1),  # type: ignore[call-arg]
        ["ConfigContainer.foo: unknown section of ConfigContainer.", "Valid sections: rng,"],
    ),
    (
        "kwarg-misspelt-section",
        lambda: ConfigContainer(trian=bc.TrainingConfig()),  # type: ignore[call-arg]
        ["ConfigContainer.trian: unknown section", "Did you mean 'train'?"],
    ),
    (
        "kwarg-missing",
        lambda: bc.GPTDatasetConfig(  # type: ignore[call-arg]
            sequence_length=8,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
        ),
        ["GPTDatasetConfig.random_seed: required field of GPTDatasetConfig is missing (int)"],
    ),
    (
        "kwarg-missing-several",
        lambda: bc.MockGPTDatasetConfig(),  # type: ignore[call-arg]
        ["MockGPTDatasetConfig.random_seed: required field", "also missing: sequence_length"],
    ),
    (
        "kwarg-computed",
        lambda: bc.SchedulerConfig(lr_decay_steps=10),  # type: ignore[call-arg]
        ["SchedulerConfig.lr_decay_steps: cannot be set", "computed by SchedulerConfig"],
    ),
    (
        "kwarg-positional",
        lambda: bc.LoggerConfig(10),  # type: ignore[call-arg]
        ["LoggerConfig: takes keyword arguments only (got positional 10)"],
    ),
    (
        "container-model-type",
        lambda: ConfigContainer(model=bc.TrainingConfig()),  # type: ignore[arg-type]
        [
            "ConfigContainer.model: TrainingConfig does not provide ModelConfigProtocol",
            "seq_length",
        ],
    ),
    (
        "container-section-type",
        lambda: ConfigContainer(train=bc.LoggerConfig()),  # type: ignore[arg-type]
        ["ConfigContainer.train: got LoggerConfig"],
    ),
]

DICT_CASES: list[tuple[str, Any, list[str]]] = [
    (
        "unknown-section",
        {"trian": {}},
        ["trian: unknown section of ConfigContainer.", "Did you mean 'train'?"],
    ),
    (
        "unknown-field",
        {"train": {"micro_batch_sise": 2}},
        [
            "train.micro_batch_sise: unknown field of TrainingConfig.",
            "Did you mean 'micro_batch_size'?",
        ],
    ),
    (
        "wrong-type",
        {"train": {"train_iters": "abc"}},
        ["train.train_iters: got 'abc' (str); expected an integer"],
    ),
    (
        "float-for-int",
        {"train": {"train_iters": 2.5}},
        ["train.train_iters: got 2.5 (float); expected an integer"],
    ),
    (
        "bool-field",
        {"logger": {"log_throughput": "yes please"}},
        ["logger.log_throughput: got 'yes please' (str); expected true or false"],
    ),
    (
        "model-needs-target",
        {"model": {"num_layers": 2}},
        ["model._target_: missing", "ModelConfigProtocol"],
    ),
    (
        "target-missing-module",
        {"model": {"_target_": "nowhere.Model"}},
        ["model._target_: cannot import 'nowhere.Model': no module named 'nowhere'"],
    ),
    (
        "target-missing-attr",
        {"model": {"_target_": "bridge.config.testing.ExampelModelConfig"}},
        [
            "model._target_",
            "has no attribute 'ExampelModelConfig'",
            "Did you mean 'ExampleModelConfig'?",
        ],
    ),
    (
        "target-wrong-protocol",
        {"model": {"_target_": "bridge.config.TrainingConfig"}},
        ["model._target_: 'bridge.config.TrainingConfig' does not provide ModelConfigProtocol"],
    ),
    (
        "target-wrong-class",
        {"train": {"_target_": "bridge.config.LoggerConfig"}},
        ["train._target_: 'bridge.config.LoggerConfig' is not a TrainingConfig"],
    ),
    (
        "required-field",
        {"dataset": {"_target_": "bridge.config.GPTDatasetConfig", "sequence_length": 8}},
        ["dataset.random_seed: required field of GPTDatasetConfig is missing (int)"],
    ),
    (
        "mock-blend-fixed",
        {
            "dataset": {
                "_target_": "bridge.config.MockGPTDatasetConfig",
                "random_seed": 1,
                "sequence_length": 8,
                **GPT_FLAGS,
                "blend": [["a"], None],
            }
        },
        ["dataset.blend: is fixed by MockGPTDatasetConfig and cannot be set"],
    ),
    ("section-not-mapping", {"train": [1, 2]}, ["train: got [1, 2] (list); expected"]),
    (
        "section-check-rerooted",
        {"train": {"micro_batch_size": 0}},
        ["train.micro_batch_size: got 0; expected a positive integer"],
    ),
    (
        "nested-check-rerooted",
        {
            "dataset": {
                "_target_": "bridge.config.FinetuningDatasetConfig",
                "seq_length": 8,
                "packed_sequence_specs": {"packed_sequence_size": -3},
            }
        },
        ["dataset.packed_sequence_specs.packed_sequence_size: got -3"],
    ),
    (
        "dtype",
        {
            "model": {
                "_target_": "bridge.config.testing.ExampleModelConfig",
                "params_dtype": "float33",
            }
        },
        ["model.params_dtype: got 'float33'", "torch dtype"],
    ),
    (
        "enum-member",
        {"train": {"exit_signal": {"_enum_": "signal.Signals.SIGNOPE"}}},
        ["train.exit_signal._enum_: got 'SIGNOPE'", "member of Signals"],
    ),
    (
        "derived-field",
        {"scheduler": {"lr_decay_steps": "many"}},
        ["scheduler.lr_decay_steps: is fixed by SchedulerConfig"],
    ),
    (
        "mixed-precision-object",
        {"mixed_precision": {"bf16": True}},
        ["mixed_precision._target_: missing"],
    ),
    (
        "literal-none-string",
        {"checkpoint": {"ckpt_format": "torch"}},
        ["checkpoint.ckpt_format: got 'torch'", "'torch_dist', 'zarr'"],
    ),
    ("top-level-not-mapping", ["train"], ["expected a mapping of sections, got list"]),
]


@pytest.mark.parametrize(
    ("thunk", "expected"), [c[1:] for c in SECTION_CASES], ids=[c[0] for c in SECTION_CASES]
)
def test_section_checks(thunk: Callable[[], Any], expected: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        thunk()
    for text in expected:
        assert text in str(info.value)


@pytest.mark.parametrize(
    ("data", "expected"), [c[1:] for c in DICT_CASES], ids=[c[0] for c in DICT_CASES]
)
def test_from_dict_errors(data: Any, expected: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        ConfigContainer.from_dict(data)
    for text in expected:
        assert text in str(info.value)


OVERRIDE_CASES: list[tuple[str, list[str], list[str]]] = [
    (
        "no-equals",
        ["train.train_iters"],
        ["train.train_iters: override has no '='", "section.field=value"],
    ),
    ("bad-key", ["train..x=1"], ["'train..x' is not a dotted field path"]),
    (
        "unknown-section",
        ["trian.train_iters=1"],
        ["trian: unknown section of ConfigContainer.", "Did you mean 'train'?"],
    ),
    (
        "unknown-field",
        ["train.train_iter=1"],
        ["train.train_iter: unknown field of TrainingConfig.", "Did you mean 'train_iters'"],
    ),
    (
        "wrong-type",
        ["train.train_iters=abc"],
        ["train.train_iters: got 'abc' (str); expected an integer"],
    ),
    (
        "derived",
        ["scheduler.lr_decay_steps=3"],
        ["scheduler.lr_decay_steps: is computed", "cannot be set"],
    ),
    (
        "target",
        ["model._target_=x.Y"],
        ["model._target_: apply_overrides cannot change a section's class"],
    ),
    (
        "unset-protocol-section",
        ["peft.alpha=1"],
        ["peft: section is not set and has no default class"],
    ),
    (
        "not-a-section",
        ["train.micro_batch_size.x=1"],
        ["train.micro_batch_size: holds 2, not a section"],
    ),
    ("unparsable", ["train.train_iters=[1,"], ["cannot parse the value '[1,'"]),
    (
        "range",
        ["train.micro_batch_size=0"],
        ["train.micro_batch_size: got 0; expected a positive integer"],
    ),
    (
        "cross-field",
        ["checkpoint.async_save=true"],
        ["checkpoint.async_save: got True; it needs save"],
    ),
    (
        "interpolation",
        ["train.train_iters=${nope.x}"],
        ["train.train_iters: cannot resolve interpolation"],
    ),
    (
        "literal",
        ["train.engine=portabel"],
        ["train.engine: got 'portabel'", "Did you mean 'portable'?"],
    ),
    ("not-string", [3], ["an override must be a string"]),  # type: ignore[list-item]
]


@pytest.mark.parametrize(
    ("overrides", "expected"), [c[1:] for c in OVERRIDE_CASES], ids=[c[0] for c in OVERRIDE_CASES]
)
def test_override_errors(
    container: ConfigContainer, overrides: list[str], expected: list[str]
) -> None:
    before = container.to_dict()
    with pytest.raises(ConfigError) as info:
        apply_overrides(container, overrides)
    for text in expected:
        assert text in str(info.value)
    assert container.to_dict() == before  # a failed override changes nothing


LOAD_CASES: list[tuple[str, list[str], list[str]]] = [
    ("unknown-section", ["trian.x=1"], ["trian: unknown section of ConfigContainer."]),
    ("literal", ["train.engine=fast"], ["train.engine: got 'fast'"]),
    (
        "target-class",
        ["dataset._target_=bridge.config.TrainingConfig"],
        ["dataset._target_: 'bridge.config.TrainingConfig' is not one of the accepted classes"],
    ),
    (
        "final-state-check",
        ["checkpoint.async_save=true"],
        ["checkpoint.async_save: got True; it needs save"],
    ),
]


@pytest.mark.parametrize(
    ("overrides", "expected"), [c[1:] for c in LOAD_CASES], ids=[c[0] for c in LOAD_CASES]
)
def test_load_config_errors(recipe: Path, overrides: list[str], expected: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(recipe, overrides)
    for text in expected:
        assert text in str(info.value)


FILE_CASES: list[tuple[str, str | None, list[str]]] = [
    ("missing", None, ["config file does not exist"]),
    ("invalid", "train:\n  micro_batch_size: [1\n", ["invalid YAML (line 3, column 1)"]),
    ("tabs", "train:\n\tmicro_batch_size: 1\n", ["invalid YAML (line 2, column 1)"]),
    ("not-mapping", "- train\n- model\n", ["top level must be a mapping of sections", "got list"]),
    (
        "interpolation",
        "train:\n  train_iters: ${model.missing}\n",
        ["cannot resolve interpolation"],
    ),
]


@pytest.mark.parametrize(
    ("content", "expected"), [c[1:] for c in FILE_CASES], ids=[c[0] for c in FILE_CASES]
)
def test_yaml_file_errors(tmp_path: Path, content: str | None, expected: list[str]) -> None:
    path = tmp_path / "config.yaml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as info:
        ConfigContainer.from_yaml(path)
    assert str(path) in str(info.value) or "train.train_iters" in str(info.value)
    for text in expected:
        assert text in str(info.value)


def test_directory_is_not_a_yaml_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory, not a YAML file"):
        ConfigContainer.from_yaml(tmp_path)


def test_refuses_to_overwrite(container: ConfigContainer, tmp_path: Path) -> None:
    path = tmp_path / "saved.yaml"
    path.write_text("precious: true\n")
    with pytest.raises(ConfigError, match="file already exists; pass overwrite=True"):
        container.to_yaml(path)
    assert path.read_text() == "precious: true\n"
    container.to_yaml(path, overwrite=True)
    assert ConfigContainer.from_yaml(path) == container
    assert [p.name for p in tmp_path.iterdir()] == ["saved.yaml"]  # no temporary file left


def test_unserialisable_value_is_named(tmp_path: Path) -> None:
    dataset = bc.FinetuningDatasetConfig(seq_length=32, dataset_kwargs={"transform": lambda x: x})
    cfg = tiny_container(dataset=dataset)
    with pytest.raises(
        ConfigError, match=r"dataset.dataset_kwargs.transform: cannot serialise .*lambda"
    ):
        cfg.to_yaml(tmp_path / "x.yaml")
    assert not (tmp_path / "x.yaml").exists()
    assert "<not serialisable:" in cfg.format_yaml()  # printing still works


VALIDATE_CASES: list[tuple[str, Callable[[], None], list[str]]] = [
    (
        "missing-train",
        lambda: ConfigContainer().validate(),
        ["train: required section is missing", "add a 'train:' mapping"],
    ),
    (
        "missing-model",
        lambda: tiny_container(model=None).validate(),
        ["model: required section is missing", "_target_"],
    ),
    (
        "missing-optimizer",
        lambda: tiny_container(optimizer=None).validate(),
        ["optimizer: required section is missing"],
    ),
    (
        "world-not-divisible",
        validate(3, model=ExampleModelConfig(tensor_model_parallel_size=2)),
        [
            "world size 3 is not divisible by tensor_model_parallel_size (2) x pipeline_model_parallel_size (1) x context_parallel_size (1) = 2"
        ],
    ),
    ("world-size", validate(0), ["world_size: got 0; expected a positive integer"]),
    (
        "gbs-multiple",
        validate(
            2, train=bc.TrainingConfig(micro_batch_size=2, global_batch_size=6, train_iters=10)
        ),
        [
            "train.global_batch_size: got 6; it must be a multiple of micro_batch_size (2) x data-parallel size (2) = 4"
        ],
    ),
    (
        "gbs-too-small",
        validate(
            4,
            train=bc.TrainingConfig(
                micro_batch_size=2,
                global_batch_size=4,
                train_iters=10,
                decrease_batch_size_if_needed=True,
            ),
        ),
        [
            "train.global_batch_size: got 4; it must be at least micro_batch_size (2) x data-parallel size (4) = 8"
        ],
    ),
    (
        "mbs-required",
        validate(1, train=bc.TrainingConfig(train_iters=10)),
        ["train.micro_batch_size: is required"],
    ),
    (
        "length-required",
        validate(1, train=bc.TrainingConfig(micro_batch_size=1)),
        ["train.train_iters: is required (or train.train_samples"],
    ),
    (
        "rampup-needs-samples",
        validate(
            1,
            train=bc.TrainingConfig(
                micro_batch_size=1,
                global_batch_size=8,
                train_iters=10,
                rampup_batch_size=[2, 2, 100],
            ),
        ),
        ["train.rampup_batch_size: batch-size ramp-up needs sample-based training"],
    ),
    (
        "rampup-increment",
        validate(
            1,
            train=bc.TrainingConfig(
                micro_batch_size=1,
                global_batch_size=8,
                train_samples=1000,
                rampup_batch_size=[2, 4, 100],
            ),
        ),
        ["minus the start batch size 2 must be a multiple of the increment 4"],
    ),
    (
        "warmup-init-above-lr",
        validate(1, scheduler=bc.SchedulerConfig(lr_warmup_iters=2, lr_warmup_init=0.5)),
        ["scheduler.lr_warmup_init: got 0.5, above optimizer.lr=0.001"],
    ),
    (
        "min-lr-above-lr",
        validate(1, optimizer=ExampleOptimizerConfig(lr=0.1, min_lr=0.2)),
        ["optimizer.min_lr: got 0.2, above optimizer.lr=0.1"],
    ),
    (
        "lr-required",
        validate(1, optimizer=ExampleOptimizerConfig(lr=None)),
        ["optimizer.lr: is required"],
    ),
    (
        "rampup-with-decrease",
        validate(
            1,
            train=bc.TrainingConfig(
                micro_batch_size=1,
                global_batch_size=8,
                train_samples=1000,
                rampup_batch_size=[2, 2, 100],
                decrease_batch_size_if_needed=True,
            ),
        ),
        ["train.rampup_batch_size: cannot be combined with train.decrease_batch_size_if_needed"],
    ),
    (
        "samples-with-iters",
        validate(1, scheduler=bc.SchedulerConfig(lr_decay_samples=100)),
        [
            "scheduler.lr_decay_samples: counts samples but train.train_iters selects iteration-based training"
        ],
    ),
    (
        "iters-with-samples",
        validate(1, train=bc.TrainingConfig(micro_batch_size=2, train_samples=1000)),
        [
            "scheduler.lr_warmup_iters: counts iterations but train.train_samples selects sample-based training"
        ],
    ),
    (
        "warmup-too-long",
        validate(1, scheduler=bc.SchedulerConfig(lr_warmup_iters=10)),
        ["scheduler: warmup (20 samples) must be shorter than the decay (20 samples)"],
    ),
    (
        "zero-length",
        validate(
            1,
            train=bc.TrainingConfig(micro_batch_size=2, train_iters=0),
            scheduler=bc.SchedulerConfig(),
        ),
        ["scheduler.lr_decay_iters: the learning rate would decay over 0 iterations"],
    ),
    (
        "seq-length",
        validate(1, model=ExampleModelConfig(seq_length=64)),
        ["dataset.sequence_length: got 32 but model.seq_length is 64; they must be equal"],
    ),
    (
        "finetune-seq-length",
        validate(1, dataset=bc.FinetuningDatasetConfig(seq_length=16)),
        ["dataset.seq_length: got 16 but model.seq_length is 32"],
    ),
    (
        "packed-mbs",
        validate(
            1,
            dataset=bc.FinetuningDatasetConfig(
                seq_length=32, packed_sequence_specs=bc.PackedSequenceSpecs(packed_sequence_size=64)
            ),
        ),
        ["train.micro_batch_size: got 2; packed sequences need micro_batch_size 1"],
    ),
    (
        "vocab",
        validate(
            1,
            tokenizer=bc.TokenizerConfig(
                tokenizer_type="NullTokenizer", vocab_size=120, vocab_extra_ids=10
            ),
        ),
        [
            "tokenizer.vocab_size: the tokenizer emits 130 ids",
            "raise model.vocab_size to at least 130",
        ],
    ),
    (
        "heads-vs-tp",
        validate(3, model=ExampleModelConfig(num_attention_heads=4, tensor_model_parallel_size=3)),
        [
            "model.num_attention_heads: got 4; it must be divisible by tensor_model_parallel_size (3)"
        ],
    ),
    (
        "cp-seq",
        validate(3, model=ExampleModelConfig(context_parallel_size=3, seq_length=32)),
        [
            "model.seq_length: got 32; with context_parallel_size 3 it must be divisible by 2 x 3 = 6"
        ],
    ),
    (
        "precision-flags",
        validate(1, model=ExampleModelConfig(bf16=True, fp16=True)),
        ["model: bf16 and fp16 are both true"],
    ),
    (
        "optimizer-flags",
        validate(1, model=ExampleModelConfig(bf16=True)),
        ["optimizer.bf16=False, optimizer.fp16=False do not match model.bf16=True"],
    ),
    (
        "params-dtype",
        validate(
            1,
            model=ExampleModelConfig(fp16=True, params_dtype=torch.bfloat16),
            optimizer=ExampleOptimizerConfig(fp16=True),
        ),
        ["model.params_dtype: got torch.bfloat16 but model.fp16 is true"],
    ),
    (
        "mixed-precision-name",
        validate(1, model=ExampleModelConfig(fp16=True), mixed_precision="bf16_mixed"),
        ["mixed_precision: 'bf16_mixed' selects bf16 but model.fp16 is true"],
    ),
    (
        "distributed-optimizer",
        validate(1, optimizer=ExampleOptimizerConfig(use_distributed_optimizer=True)),
        [
            "ddp.use_distributed_optimizer: got False but optimizer.use_distributed_optimizer is True"
        ],
    ),
    (
        "ft-needs-save",
        validate(1, ft=bc.FaultToleranceConfig(enable_ft_package=True)),
        [
            "ft.enable_ft_package: fault tolerance restarts training from checkpoints; set checkpoint.save"
        ],
    ),
    (
        "ft-rank",
        validate(2, ft=bc.FaultToleranceConfig(simulated_fault_rank=2)),
        ["ft.simulated_fault_rank: got 2; the world has ranks 0 to 1"],
    ),
    (
        "profile-ranks",
        validate(2, profiling=bc.ProfilingConfig(profile_ranks=[0, 5])),
        ["profiling.profile_ranks: rank(s) [5] do not exist"],
    ),
    (
        "peft",
        validate(1, peft=IdentityPEFT()),
        ["checkpoint.pretrained_checkpoint: is required with peft"],
    ),
    (
        "ep-world",
        validate(6, model=ExampleModelConfig(expert_model_parallel_size=4)),
        [
            "model.expert_model_parallel_size: got 4; world size 6 is not divisible by "
            "expert_tensor_parallel_size (1) x expert_model_parallel_size (4) x "
            "pipeline_model_parallel_size (1) = 4",
            "valid expert_model_parallel_size values for 6 ranks: 1, 2, 3, 6",
        ],
    ),
    (
        "ep-world-with-tp",
        validate(
            4,
            model=ExampleModelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=4),
        ),
        [
            "model.expert_model_parallel_size: got 4; world size 4 is not divisible by "
            "expert_tensor_parallel_size (2) x expert_model_parallel_size (4)",
            "values for 4 ranks: 1, 2 (or launch a multiple of 8 ranks)",
        ],
    ),
    (
        "ep-experts",
        validate(6, model=moe(expert_model_parallel_size=3, num_moe_experts=8)),
        [
            "model.expert_model_parallel_size: got 3; num_moe_experts (8) is not divisible by it",
            "valid expert_model_parallel_size values for 6 ranks: 1, 2",
        ],
    ),
    (
        "ep-needs-experts",
        validate(2, model=moe(expert_model_parallel_size=2)),
        ["model.num_moe_experts: is unset but expert_model_parallel_size is 2"],
    ),
    (
        "etp-world",
        validate(
            4,
            model=moe(
                expert_model_parallel_size=2, num_moe_experts=8, expert_tensor_parallel_size=3
            ),
        ),
        [
            "model.expert_tensor_parallel_size: got 3; world size 4 is not divisible by "
            "expert_tensor_parallel_size (3) x expert_model_parallel_size (2)",
            "expert_tensor_parallel_size values for 4 ranks: 1, 2 (or leave it unset",
        ],
    ),
    (
        "ep-not-an-int",
        validate(2, model=ExampleModelConfig(expert_model_parallel_size=0)),
        ["model.expert_model_parallel_size: got 0; expected a positive integer"],
    ),
    (
        "finetune-seq-length-unset",
        validate(1, dataset=bc.FinetuningDatasetConfig()),
        ["dataset.seq_length: is required for a finetuning dataset", "model.seq_length (32)"],
    ),
    (
        "comm-overlap-dp",
        validate(2, comm_overlap=ExampleCommOverlapConfig(data_parallel_size=4)),
        ["comm_overlap.data_parallel_size: got 4 but the data-parallel size is 2"],
    ),
]


@pytest.mark.parametrize(
    ("thunk", "expected"), [c[1:] for c in VALIDATE_CASES], ids=[c[0] for c in VALIDATE_CASES]
)
def test_validate_errors(thunk: Callable[[], None], expected: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        thunk()
    for text in expected:
        assert text in str(info.value)


def test_validate_rechecks_sections_changed_after_construction(container: ConfigContainer) -> None:
    assert container.train is not None
    container.train.micro_batch_size = -1
    with pytest.raises(
        ConfigError, match=r"^train.micro_batch_size: got -1; expected a positive integer$"
    ):
        container.validate(world_size=1)


@pytest.mark.parametrize(
    "call",
    [
        lambda: bc.TrainingConfig(train_iter=1),  # type: ignore[call-arg]
        lambda: ConfigContainer(foo=1),  # type: ignore[call-arg]
        lambda: bc.FinetuningDatasetConfig(seq_len=8),  # type: ignore[call-arg]
        lambda: bc.GPTDatasetConfig(random_seed=1),  # type: ignore[call-arg]
        lambda: bc.RNGConfig(1),  # type: ignore[call-arg]
    ],
    ids=["unknown", "unknown-section", "unknown-subclass-field", "missing", "positional"],
)
def test_bad_keyword_arguments_are_type_errors_too(call: Callable[[], Any]) -> None:
    """Code that catches the TypeError a bad call raises keeps working."""
    with pytest.raises(TypeError) as info:
        call()
    assert isinstance(info.value, ConfigError)


def test_keyword_checks_leave_valid_calls_and_copies_alone() -> None:
    import copy
    import pickle

    train = bc.TrainingConfig(micro_batch_size=2, train_iters=10)
    assert copy.deepcopy(train) == train and pickle.loads(pickle.dumps(train)) == train
    assert dataclasses.replace(train, train_iters=20).train_iters == 20
    with pytest.raises(ConfigError, match=r"TrainingConfig.train_itres: unknown field"):
        dataclasses.replace(train, train_itres=20)  # type: ignore[call-arg]


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        bc.TrainingConfig(micro_batch_size=0)
    error = ConfigError("train.x", "bad")
    assert (error.location, error.detail, str(error)) == ("train.x", "bad", "train.x: bad")
