"""Typed training configuration: sections with checks, YAML round-trip and dotted overrides."""

from bridge.config._checkpoint import CheckpointConfig
from bridge.config._codec import register_moved_import
from bridge.config._container import ConfigContainer, data_parallel_size, resolve_world_size
from bridge.config._convert import convert_dataclass
from bridge.config._data import (
    DataloaderConfig,
    FinetuningDatasetConfig,
    GPTDatasetConfig,
    MockGPTDatasetConfig,
    PackedSequenceSpecs,
    parse_split,
)
from bridge.config._ddp import DistributedDataParallelConfig
from bridge.config._diff import ConfigDiff, diff_from_defaults, flatten_config, format_diff
from bridge.config._errors import ConfigError
from bridge.config._fields import FieldInfo, describe_fields
from bridge.config._logger import LoggerConfig, ProfilingConfig
from bridge.config._overrides import apply_overrides, load_config, parse_overrides
from bridge.config._protocols import (
    CommOverlapConfigProtocol,
    DDPConfigProtocol,
    MixedPrecisionConfigProtocol,
    ModelConfigProtocol,
    OptimizerConfigProtocol,
    PEFTProtocol,
    TokenizerConfigProtocol,
)
from bridge.config._resiliency import (
    FaultToleranceConfig,
    NVRxStragglerDetectionConfig,
    StragglerDetectionConfig,
)
from bridge.config._runtime import DistributedInitConfig, RerunStateMachineConfig, RNGConfig
from bridge.config._samples import SamplesConfig
from bridge.config._tokenizer import TOKENIZER_REQUIRED_FIELDS, TokenizerConfig
from bridge.config._training import (
    SchedulerConfig,
    TrainingConfig,
    rampup_increments,
    scheduler_steps,
)
from bridge.config._value_ranges import check_learning_rates

__all__ = [
    "TOKENIZER_REQUIRED_FIELDS",
    "CheckpointConfig",
    "CommOverlapConfigProtocol",
    "ConfigContainer",
    "ConfigDiff",
    "ConfigError",
    "DDPConfigProtocol",
    "DataloaderConfig",
    "DistributedDataParallelConfig",
    "DistributedInitConfig",
    "FaultToleranceConfig",
    "FieldInfo",
    "FinetuningDatasetConfig",
    "GPTDatasetConfig",
    "LoggerConfig",
    "MixedPrecisionConfigProtocol",
    "MockGPTDatasetConfig",
    "ModelConfigProtocol",
    "NVRxStragglerDetectionConfig",
    "OptimizerConfigProtocol",
    "PEFTProtocol",
    "PackedSequenceSpecs",
    "ProfilingConfig",
    "RNGConfig",
    "RerunStateMachineConfig",
    "SamplesConfig",
    "SchedulerConfig",
    "StragglerDetectionConfig",
    "TokenizerConfig",
    "TokenizerConfigProtocol",
    "TrainingConfig",
    "apply_overrides",
    "check_learning_rates",
    "convert_dataclass",
    "data_parallel_size",
    "describe_fields",
    "diff_from_defaults",
    "flatten_config",
    "format_diff",
    "load_config",
    "parse_overrides",
    "parse_split",
    "rampup_increments",
    "register_moved_import",
    "resolve_world_size",
    "scheduler_steps",
]
