"""Smoke test of the public API: every name of the reference is exported and importable."""

from __future__ import annotations

import importlib
import subprocess
import sys

import core_utils

# Every public name of megatron-core's core.utils reference (004), in the reference's order.
REFERENCE_PUBLIC_NAMES = [
    "GlobalMemoryBuffer",
    "GlobalSymmetricMemoryBuffer",
    "WrappedTensor",
    "MakeViewlessTensor",
    "StragglerDetector",
    "null_decorator",
    "experimental_fn",
    "experimental_cls",
    "get_torch_version",
    "get_te_version",
    "is_te_min_version",
    "is_torch_min_version",
    "get_fa_version",
    "is_fa_min_version",
    "get_mamba_version",
    "is_mamba_min_version",
    "get_causal_conv1d_version",
    "is_causal_conv1d_min_version",
    "check_mamba_sequence_packing_support",
    "ensure_divisibility",
    "divide",
    "deprecate_inference_params",
    "get_tensor_model_parallel_group_if_none",
    "get_pg_size",
    "get_pg_rank",
    "get_pg_src_rank",
    "get_attr_wrapped_model",
    "get_model_type",
    "get_model_xattn",
    "get_model_config",
    "make_viewless_tensor",
    "assert_viewless_tensor",
    "safely_set_viewless_tensor_data",
    "init_method_normal",
    "scaled_init_method_normal",
    "log_single_rank",
    "log_on_each_pipeline_stage",
    "check_param_hashes_across_dp_replicas",
    "make_tp_sharded_tensor_for_checkpoint",
    "make_sharded_tensor_for_checkpoint",
    "get_full_tensor_if_necessary",
    "to_local_if_dtensor",
    "get_data_parallel_group_if_dtensor",
    "prepare_input_tensors_for_wgrad_compute",
    "drain_embedding_wgrad_compute",
    "local_multi_tensor_applier",
    "local_multi_tensor_l2_norm",
    "local_multi_tensor_scale",
    "is_submodule",
    "get_batch_on_this_cp_rank",
    "configure_nvtx_profiling",
    "nvtx_range_push",
    "nvtx_range_pop",
    "nvtx_decorator",
    "unwrap_model",
    "maybe_cat",
    "get_asyncio_loop",
    "trace_async_exceptions",
    "get_mamba_inference_state_config_from_model",
    "deprecated",
    "internal_api",
    "experimental_api",
    "ExperimentalNotEnabledError",
    "logger",
]
# Internal names of the reference, reachable from their modules.
REFERENCE_PRIVATE_NAMES = {
    "core_utils": ["__straggler__"],
    "core_utils.straggler": ["_ValueWithRank", "_StragglerData"],
    "core_utils.viewless": ["_kernel_make_viewless_tensor"],
    "core_utils.nvtx": [
        "_nvtx_range_get_func_path",
        "_nvtx_decorator_get_func_path",
        "_nvtx_enabled",
        "_nvtx_range_messages",
    ],
    "core_utils.async_utils": ["_ASYNC_IO_LOOP", "_ASYNC_TASK_STATS"],
}


def test_every_reference_name_is_exported_and_importable() -> None:
    missing = [name for name in REFERENCE_PUBLIC_NAMES if name not in core_utils.__all__]
    assert not missing, f"not in core_utils.__all__: {missing}"
    for name in core_utils.__all__:
        assert getattr(core_utils, name) is not None, name
    namespace: dict[str, object] = {}
    exec("from core_utils import *", namespace)
    assert set(core_utils.__all__) <= set(namespace)


def test_all_has_no_duplicates_and_is_sorted() -> None:
    assert len(set(core_utils.__all__)) == len(core_utils.__all__)
    assert core_utils.__all__ == sorted(core_utils.__all__)


def test_reference_private_names_exist_in_their_modules() -> None:
    for module_name, names in REFERENCE_PRIVATE_NAMES.items():
        module = importlib.import_module(module_name)
        for name in names:
            assert hasattr(module, name), f"{module_name}.{name}"


def test_public_callables_have_docstrings() -> None:
    undocumented = [
        name
        for name in core_utils.__all__
        if callable(getattr(core_utils, name)) and not getattr(core_utils, name).__doc__
    ]
    assert not undocumented


def test_straggler_singleton_is_the_module_instance() -> None:
    assert core_utils.__straggler__ is core_utils.StragglerDetector()


def test_import_loads_no_megatron_or_optional_package() -> None:
    code = (
        "import sys, core_utils\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', "
        "'transformer_engine', 'flash_attn', 'mamba_ssm', 'causal_conv1d', 'pynvml', "
        "'apex', 'amp_C', 'nvtx', 'fused_weight_gradient_mlp_cuda'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=180)
