"""Megatron-style core utilities, importable without megatron-core.

Everything megatron-core's ``megatron.core.utils`` offers (parallel-group helpers, viewless
tensors, memory buffers, version checks, straggler detection, ...) plus CPU-capable
:class:`Timers`, the :func:`cpu_cuda_compat` layer and the :func:`cuda_emulation` that runs
megatron-core's training machinery on CPU. Importing this package never imports
megatron-core or an optional package; the few functions that need megatron-core import it
when called.
"""

from core_utils.arithmetic import divide, ensure_divisibility
from core_utils.async_utils import get_asyncio_loop, trace_async_exceptions
from core_utils.callbacks import Callback, CallbackError, CallbackList
from core_utils.context_parallel import get_batch_on_this_cp_rank
from core_utils.cuda_compat import cpu_cuda_compat, cuda_compat_active
from core_utils.cuda_emulation import (
    CudaEmulationError,
    cuda_emulation,
    cuda_emulation_active,
    without_device_rewriting,
)
from core_utils.decorators import (
    deprecate_inference_params,
    deprecated,
    experimental_api,
    internal_api,
    null_decorator,
)
from core_utils.dtensor import (
    get_data_parallel_group_if_dtensor,
    get_full_tensor_if_necessary,
    to_local_if_dtensor,
)
from core_utils.experimental import (
    ExperimentalNotEnabledError,
    experimental_cls,
    experimental_fn,
    is_experimental_enabled,
    set_experimental_enabled,
)
from core_utils.init_methods import init_method_normal, scaled_init_method_normal
from core_utils.log_utils import log_on_each_pipeline_stage, log_single_rank, logger
from core_utils.mamba import get_mamba_inference_state_config_from_model
from core_utils.memory_buffers import GlobalMemoryBuffer, GlobalSymmetricMemoryBuffer
from core_utils.model_wrapping import (
    get_attr_wrapped_model,
    get_model_config,
    get_model_type,
    get_model_xattn,
    is_submodule,
    unwrap_model,
)
from core_utils.multi_tensor import (
    local_multi_tensor_applier,
    local_multi_tensor_l2_norm,
    local_multi_tensor_scale,
)
from core_utils.nvtx import (
    configure_nvtx_profiling,
    nvtx_decorator,
    nvtx_range_pop,
    nvtx_range_push,
)
from core_utils.param_hashes import check_param_hashes_across_dp_replicas
from core_utils.process_groups import (
    get_pg_rank,
    get_pg_size,
    get_pg_src_rank,
    get_tensor_model_parallel_group_if_none,
)
from core_utils.sharded_checkpoint import (
    make_sharded_tensor_for_checkpoint,
    make_tp_sharded_tensor_for_checkpoint,
)
from core_utils.straggler import StragglerDetector
from core_utils.tensor_utils import WrappedTensor, maybe_cat
from core_utils.timers import Timers
from core_utils.versions import (
    MissingPackageError,
    check_mamba_sequence_packing_support,
    get_causal_conv1d_version,
    get_fa_version,
    get_mamba_version,
    get_te_version,
    get_torch_version,
    is_causal_conv1d_min_version,
    is_fa_min_version,
    is_mamba_min_version,
    is_te_min_version,
    is_torch_min_version,
)
from core_utils.viewless import (
    MakeViewlessTensor,
    assert_viewless_tensor,
    make_viewless_tensor,
    safely_set_viewless_tensor_data,
)
from core_utils.wgrad import drain_embedding_wgrad_compute, prepare_input_tensors_for_wgrad_compute

#: The process's StragglerDetector singleton (the same object as ``StragglerDetector()``).
__straggler__ = StragglerDetector()

__all__ = [
    "Callback",
    "CallbackError",
    "CallbackList",
    "CudaEmulationError",
    "ExperimentalNotEnabledError",
    "GlobalMemoryBuffer",
    "GlobalSymmetricMemoryBuffer",
    "MakeViewlessTensor",
    "MissingPackageError",
    "StragglerDetector",
    "Timers",
    "WrappedTensor",
    "assert_viewless_tensor",
    "check_mamba_sequence_packing_support",
    "check_param_hashes_across_dp_replicas",
    "configure_nvtx_profiling",
    "cpu_cuda_compat",
    "cuda_compat_active",
    "cuda_emulation",
    "cuda_emulation_active",
    "deprecate_inference_params",
    "deprecated",
    "divide",
    "drain_embedding_wgrad_compute",
    "ensure_divisibility",
    "experimental_api",
    "experimental_cls",
    "experimental_fn",
    "get_asyncio_loop",
    "get_attr_wrapped_model",
    "get_batch_on_this_cp_rank",
    "get_causal_conv1d_version",
    "get_data_parallel_group_if_dtensor",
    "get_fa_version",
    "get_full_tensor_if_necessary",
    "get_mamba_inference_state_config_from_model",
    "get_mamba_version",
    "get_model_config",
    "get_model_type",
    "get_model_xattn",
    "get_pg_rank",
    "get_pg_size",
    "get_pg_src_rank",
    "get_te_version",
    "get_tensor_model_parallel_group_if_none",
    "get_torch_version",
    "init_method_normal",
    "internal_api",
    "is_causal_conv1d_min_version",
    "is_experimental_enabled",
    "is_fa_min_version",
    "is_mamba_min_version",
    "is_submodule",
    "is_te_min_version",
    "is_torch_min_version",
    "local_multi_tensor_applier",
    "local_multi_tensor_l2_norm",
    "local_multi_tensor_scale",
    "log_on_each_pipeline_stage",
    "log_single_rank",
    "logger",
    "make_sharded_tensor_for_checkpoint",
    "make_tp_sharded_tensor_for_checkpoint",
    "make_viewless_tensor",
    "maybe_cat",
    "null_decorator",
    "nvtx_decorator",
    "nvtx_range_pop",
    "nvtx_range_push",
    "prepare_input_tensors_for_wgrad_compute",
    "safely_set_viewless_tensor_data",
    "scaled_init_method_normal",
    "set_experimental_enabled",
    "to_local_if_dtensor",
    "trace_async_exceptions",
    "unwrap_model",
    "without_device_rewriting",
]
