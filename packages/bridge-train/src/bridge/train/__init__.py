"""bridge.train: the trainer on megatron-core's engine, its entry points and the reference API."""

import logging
from typing import TYPE_CHECKING

from bridge.config import register_moved_import
from bridge.train._lazy_exports import lazy_exports

if TYPE_CHECKING:  # the exports (type checkers read them; _MODULE_OF below is derived)
    from bridge.logging import (
        MEMORY_KEYS as MEMORY_KEYS,
        reduce_max_memory_across_pp_group as reduce_max_memory_across_pp_group,
        report_l2_norm_grad as report_l2_norm_grad,
        report_memory as report_memory,
        report_runtime as report_runtime,
        report_throughput as report_throughput,
        start_memory_history_recording as start_memory_history_recording,
        training_log as training_log,
    )
    from bridge.train.api.eval import (
        evaluate as evaluate,
        evaluate_and_print_results as evaluate_and_print_results,
    )
    from bridge.train.api.train import (
        checkpoint_and_decide_exit as checkpoint_and_decide_exit,
        post_training_step_callbacks as post_training_step_callbacks,
        save_checkpoint_and_time as save_checkpoint_and_time,
        train as train,
        train_step as train_step,
    )
    from bridge.train.loop.forward_pre_hooks import (
        disable_forward_pre_hook as disable_forward_pre_hook,
        enable_forward_pre_hook as enable_forward_pre_hook,
        should_disable_forward_pre_hook as should_disable_forward_pre_hook,
    )
    from bridge.train.loop.pretrain import (
        pretrain as pretrain,
        setup as setup,
    )
    from bridge.train.loop.profiling import (
        TNvtxContext as TNvtxContext,
    )
    from bridge.train.loop.progress_log import (
        compute_throughputs_and_append_to_progress_log as compute_throughputs_and_append_to_progress_log,
        get_start_time_from_progress_log as get_start_time_from_progress_log,
    )
    from bridge.train.loop.state_injection import (
        maybe_inject_state as maybe_inject_state,
        needs_global_state_injection as needs_global_state_injection,
        prepare_forward_step_func as prepare_forward_step_func,
    )
    from bridge.train.metrics.norms import (
        calc_dtensor_params_l2_norm as calc_dtensor_params_l2_norm,
        calc_params_l2_norm as calc_params_l2_norm,
        param_is_not_shared as param_is_not_shared,
    )
    from bridge.train.metrics.reductions import (
        logical_and_across_model_parallel_group as logical_and_across_model_parallel_group,
        reduce_max_stat_across_model_parallel_group as reduce_max_stat_across_model_parallel_group,
    )
    from bridge.train.models import (
        GPTModelProvider as GPTModelProvider,
        MambaProvider as MambaProvider,
        T5ModelProvider as T5ModelProvider,
    )
    from bridge.train.models.gpt_step import (
        forward_step as forward_step,
    )
    from bridge.train.models.moe_utils import (
        freeze_moe_router as freeze_moe_router,
    )
    from bridge.train.models.t5_step import (
        t5_forward_step as t5_forward_step,
    )
    from bridge.train.models.value_head import (
        LinearForLastLayer as LinearForLastLayer,
        ModelHook as ModelHook,
        ModelList as ModelList,
        create_value_head_hook as create_value_head_hook,
        make_value_model as make_value_model,
    )
    from bridge.train.peft import (
        LoRA as LoRA,
    )
    from bridge.train.state import (
        ForwardStepCallable as ForwardStepCallable,
        GlobalState as GlobalState,
        TrainState as TrainState,
    )
    from core_utils.callbacks import (
        Callback as Callback,
        CallbackError as CallbackError,
    )
    from core_utils.loop import (
        LoopContext as LoopContext,
        StepResult as StepResult,
    )

# Every public name is imported on first use, not with the package: the ``bridge-train``
# command answers --help, --version and configuration errors without importing torch or
# megatron-core (about ten seconds), and ``import bridge.train`` stays cheap. The
# TYPE_CHECKING block above is the one table (name -> module); __all__ and the lookup are
# derived from it.
_MODULE_OF = lazy_exports(globals())


# Modules that moved in the one-engine redesign (Nov 2026): configs saved before it
# (run_config.yaml in checkpoints, users' recipes) name the old paths.
for _old, _new in (
    ("bridge.train.recipes.mimo", "bridge.train.models.mimo"),
    ("bridge.train.comm_overlap", "bridge.train.engine.comm_overlap"),
    ("bridge.train.gpt_step", "bridge.train.models.gpt_step"),
    ("bridge.train.t5_step", "bridge.train.models.t5_step"),
    ("bridge.train.value_head", "bridge.train.models.value_head"),
):
    register_moved_import(_old, _new)

logger = logging.getLogger(__name__)
"""The trainer's logger (``bridge.train``): every module of the package logs below it, so
its level and handlers govern all of the trainer's log records."""

__all__ = sorted([*_MODULE_OF, "logger"])
