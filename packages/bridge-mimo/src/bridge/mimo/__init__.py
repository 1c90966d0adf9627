"""Heterogeneous parallel training of multi-module (MIMO) models.

Each module of a model (vision encoder, language model, ...) runs on its own ranks with its
own parallel layout (a megatron-core ``HyperCommGrid`` per module); encoder embeddings go to
the language-model ranks and their gradients come back; every module finalizes its
gradients over its own data-parallel group. See ``docs/mimo.md``.
"""

from bridge.mimo.comm_plan import CrossModulePlan, SampleTransfer
from bridge.mimo.communicator import (
    MegatronBridgeModuleCommunicator,
    ModuleCommunicator,
    P2PModuleCommunicator,
    PendingSends,
)
from bridge.mimo.communicator_choice import (
    CommunicatorChoice,
    CommunicatorKind,
    choose_communicator,
)
from bridge.mimo.data import MapDataset, MimoDataLoader
from bridge.mimo.flops import StepFlopsMeter
from bridge.mimo.infra import MegatronMIMOInfra, build_megatron_mimo_infra
from bridge.mimo.layout import LANGUAGE_MODULE_KEY, MimoLayout, ModulePlacement
from bridge.mimo.model import build_mimo_model, module_init_seed
from bridge.mimo.optimizer import (
    MultiModuleOptimizer,
    OptimizerFactory,
    build_multimodule_optimizer,
)

# The reference's private helper stays importable from the package, not in __all__.
from bridge.mimo.parallel_utils import (
    _get_dp_size_from_grid as _get_dp_size_from_grid,
    build_pg_collection_for_schedule,
    finalize_model_grads_multimodule,
    get_active_module_pg,
    get_module_to_grid_tuple,
    is_current_rank_in_grid,
    multimodule_no_sync,
    unwrap_megatron_mimo_model,
    validate_data_loader_contract,
    validate_no_stub_ranks,
    zero_grad_buffer_for_multimodule,
)
from bridge.mimo.synthetic import SyntheticImageCaptionDataset
from bridge.mimo.tiny_vlm import TinyVLMConfig, tiny_vlm_specs
from bridge.mimo.training import (
    LossFn,
    MimoLogFn,
    MimoLogger,
    MimoLogRecord,
    MimoLoopContext,
    MimoProgress,
    MimoStepFunction,
    MimoStepResult,
    MimoTrainResult,
    MimoTrainStep,
    ParamScheduler,
    ShouldStop,
    masked_token_loss,
    mimo_log_record,
    train_mimo,
)
from bridge.mimo.vision import PatchEncoder, ProjectionMLP

__all__ = [
    "LANGUAGE_MODULE_KEY",
    "CommunicatorChoice",
    "CommunicatorKind",
    "CrossModulePlan",
    "LossFn",
    "MapDataset",
    "MegatronBridgeModuleCommunicator",
    "MegatronMIMOInfra",
    "MimoDataLoader",
    "MimoLayout",
    "MimoLogFn",
    "MimoLogRecord",
    "MimoLogger",
    "MimoLoopContext",
    "MimoProgress",
    "MimoStepFunction",
    "MimoStepResult",
    "MimoTrainResult",
    "MimoTrainStep",
    "ModuleCommunicator",
    "ModulePlacement",
    "MultiModuleOptimizer",
    "OptimizerFactory",
    "P2PModuleCommunicator",
    "ParamScheduler",
    "PatchEncoder",
    "PendingSends",
    "ProjectionMLP",
    "SampleTransfer",
    "ShouldStop",
    "StepFlopsMeter",
    "SyntheticImageCaptionDataset",
    "TinyVLMConfig",
    "build_megatron_mimo_infra",
    "build_mimo_model",
    "build_multimodule_optimizer",
    "build_pg_collection_for_schedule",
    "choose_communicator",
    "finalize_model_grads_multimodule",
    "get_active_module_pg",
    "get_module_to_grid_tuple",
    "is_current_rank_in_grid",
    "masked_token_loss",
    "mimo_log_record",
    "module_init_seed",
    "multimodule_no_sync",
    "tiny_vlm_specs",
    "train_mimo",
    "unwrap_megatron_mimo_model",
    "validate_data_loader_contract",
    "validate_no_stub_ranks",
    "zero_grad_buffer_for_multimodule",
]
