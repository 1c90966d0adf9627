"""bridge.train: megatron-core training on the portable (CPU/GPU) or megatron (CUDA) engine."""

import importlib
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bridge.logging import (
        MEMORY_KEYS,
        reduce_max_memory_across_pp_group,
        report_l2_norm_grad,
        report_memory,
        report_runtime,
        report_throughput,
        start_memory_history_recording,
        training_log,
    )
    from bridge.train.gpt_step import forward_step
    from bridge.train.models import (
        GPTModelProvider,
        MambaProvider,
        T5ModelProvider,
    )
    from bridge.train.moe_utils import freeze_moe_router
    from bridge.train.norms import (
        calc_dtensor_params_l2_norm,
        calc_params_l2_norm,
        param_is_not_shared,
    )
    from bridge.train.peft import LoRA
    from bridge.train.reductions import (
        logical_and_across_model_parallel_group,
        reduce_max_stat_across_model_parallel_group,
    )
    from bridge.train.state import (
        GlobalState,
        TrainState,
    )
    from bridge.train.state_injection import (
        ForwardStepCallable,
        maybe_inject_state,
        needs_global_state_injection,
        prepare_forward_step_func,
    )
    from bridge.train.t5_step import t5_forward_step
    from bridge.train.training import (
        TNvtxContext,
        checkpoint_and_decide_exit,
        compute_throughputs_and_append_to_progress_log,
        disable_forward_pre_hook,
        enable_forward_pre_hook,
        evaluate,
        evaluate_and_print_results,
        get_start_time_from_progress_log,
        post_training_step_callbacks,
        pretrain,
        save_checkpoint_and_time,
        setup,
        should_disable_forward_pre_hook,
        train,
        train_step,
    )
    from bridge.train.training.loop import LoopContext, StepResult
    from bridge.train.value_head import (
        LinearForLastLayer,
        ModelHook,
        ModelList,
        create_value_head_hook,
        make_value_model,
    )
    from core_utils.callbacks import Callback, CallbackError

# Every public name is imported on first use, not with the package: the ``bridge-train``
# command answers --help, --version and configuration errors without importing torch or
# megatron-core (about ten seconds), and ``import bridge.train`` stays cheap.
_LAZY_NAMES: dict[str, str] = {
    "Callback": "core_utils.callbacks",
    "CallbackError": "core_utils.callbacks",
    "LoopContext": "bridge.train.training.loop",
    "StepResult": "bridge.train.training.loop",
    "MEMORY_KEYS": "bridge.logging",
    "reduce_max_memory_across_pp_group": "bridge.logging",
    "report_l2_norm_grad": "bridge.logging",
    "report_memory": "bridge.logging",
    "report_runtime": "bridge.logging",
    "report_throughput": "bridge.logging",
    "start_memory_history_recording": "bridge.logging",
    "training_log": "bridge.logging",
    "forward_step": "bridge.train.gpt_step",
    "GPTModelProvider": "bridge.train.models",
    "MambaProvider": "bridge.train.models",
    "T5ModelProvider": "bridge.train.models",
    "freeze_moe_router": "bridge.train.moe_utils",
    "calc_dtensor_params_l2_norm": "bridge.train.norms",
    "calc_params_l2_norm": "bridge.train.norms",
    "param_is_not_shared": "bridge.train.norms",
    "LoRA": "bridge.train.peft",
    "logical_and_across_model_parallel_group": "bridge.train.reductions",
    "reduce_max_stat_across_model_parallel_group": "bridge.train.reductions",
    "GlobalState": "bridge.train.state",
    "TrainState": "bridge.train.state",
    "ForwardStepCallable": "bridge.train.state_injection",
    "maybe_inject_state": "bridge.train.state_injection",
    "needs_global_state_injection": "bridge.train.state_injection",
    "prepare_forward_step_func": "bridge.train.state_injection",
    "t5_forward_step": "bridge.train.t5_step",
    "TNvtxContext": "bridge.train.training",
    "checkpoint_and_decide_exit": "bridge.train.training",
    "compute_throughputs_and_append_to_progress_log": "bridge.train.training",
    "disable_forward_pre_hook": "bridge.train.training",
    "enable_forward_pre_hook": "bridge.train.training",
    "evaluate": "bridge.train.training",
    "evaluate_and_print_results": "bridge.train.training",
    "get_start_time_from_progress_log": "bridge.train.training",
    "post_training_step_callbacks": "bridge.train.training",
    "pretrain": "bridge.train.training",
    "save_checkpoint_and_time": "bridge.train.training",
    "setup": "bridge.train.training",
    "should_disable_forward_pre_hook": "bridge.train.training",
    "train": "bridge.train.training",
    "train_step": "bridge.train.training",
    "LinearForLastLayer": "bridge.train.value_head",
    "ModelHook": "bridge.train.value_head",
    "ModelList": "bridge.train.value_head",
    "create_value_head_hook": "bridge.train.value_head",
    "make_value_model": "bridge.train.value_head",
}


def __getattr__(name: str) -> Any:
    module = _LAZY_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_NAMES))


logger = logging.getLogger(__name__)
"""The trainer's logger (``bridge.train``): every module of the package logs below it, so
its level and handlers govern all of the trainer's log records."""

__all__ = [
    "MEMORY_KEYS",
    "Callback",
    "CallbackError",
    "ForwardStepCallable",
    "GPTModelProvider",
    "GlobalState",
    "LinearForLastLayer",
    "LoRA",
    "LoopContext",
    "MambaProvider",
    "ModelHook",
    "ModelList",
    "StepResult",
    "T5ModelProvider",
    "TNvtxContext",
    "TrainState",
    "calc_dtensor_params_l2_norm",
    "calc_params_l2_norm",
    "checkpoint_and_decide_exit",
    "compute_throughputs_and_append_to_progress_log",
    "create_value_head_hook",
    "disable_forward_pre_hook",
    "enable_forward_pre_hook",
    "evaluate",
    "evaluate_and_print_results",
    "forward_step",
    "freeze_moe_router",
    "get_start_time_from_progress_log",
    "logger",
    "logical_and_across_model_parallel_group",
    "make_value_model",
    "maybe_inject_state",
    "needs_global_state_injection",
    "param_is_not_shared",
    "post_training_step_callbacks",
    "prepare_forward_step_func",
    "pretrain",
    "reduce_max_memory_across_pp_group",
    "reduce_max_stat_across_model_parallel_group",
    "report_l2_norm_grad",
    "report_memory",
    "report_runtime",
    "report_throughput",
    "save_checkpoint_and_time",
    "setup",
    "should_disable_forward_pre_hook",
    "start_memory_history_recording",
    "t5_forward_step",
    "train",
    "train_step",
    "training_log",
]
