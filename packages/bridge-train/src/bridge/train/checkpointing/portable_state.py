"""Optimizer state saved by the retired portable engine, converted for megatron-core's optimizer.

bridge-train's former portable engine saved its optimizer (a torch Adam/SGD behind
megatron's optimizer contract) as ``{"optimizer": <torch state dict>, "grad_scaler": ...,
"fp32_from_fp16_params": ...}``, with every per-parameter tensor (``exp_avg``,
``exp_avg_sq``, ``momentum_buffer``, fp32 main parameters) stored under its parameter's
sharded key exactly as megatron-core's own non-distributed optimizers store them
(``optimizer.state.<name>.<parameter key>``, ``optimizer.state.fp32_param.<key>``), and the
per-parameter ``step`` once as ``common_step``. So the tensors load into megatron's template
unchanged; only the non-tensor layout around them differs: megatron's ``FP32Optimizer``
keeps the bare torch state dict, its mixed-precision optimizer the same nesting as the
portable one. :func:`convert_portable_optimizer_state` rebuilds that layout from the loaded
tensors, the saved step and loss scale, and the current optimizer's own parameter groups
(their hyperparameters are the config's; the learning rate and weight decay come from the
restored scheduler), so the moments, step, loss scale and main parameters carry over and
the run continues where the portable run stopped.

Converted: one optimizer over all parameters (what the portable engine built without
expert parallelism), fp32 or bf16/fp16 with fp32 main parameters. Refused with the fix:
megatron's distributed optimizer (see ``load._check_reshardable``) and a chained optimizer
of several parts (MoE expert parameters get their own): this conversion builds one
non-distributed optimizer's state.
"""

from __future__ import annotations

from typing import Any

from bridge.train.checkpointing.errors import CheckpointError

__all__ = ["PORTABLE_OPTIMIZER_FORMAT", "convert_portable_optimizer_state"]

PORTABLE_OPTIMIZER_FORMAT = "portable"
"""``optimizer_format`` in the metadata of a checkpoint saved by the portable engine."""


def convert_portable_optimizer_state(optimizer: Any, loaded: dict[str, Any], path: str) -> Any:
    """The portable engine's loaded optimizer state in the layout ``optimizer`` loads.

    Args:
        optimizer: megatron-core's optimizer of this run (``get_megatron_optimizer``'s
            result: a ``ChainedOptimizer`` of one ``FP32Optimizer`` or
            ``Float16OptimizerWithFloat16Params``, or one of those).
        loaded: ``dist_checkpointing.load``'s ``"optimizer"`` entry for a template built
            from ``optimizer``: the checkpoint's non-tensor portable state merged with the
            tensors loaded at the template's places.
        path: The checkpoint directory (for messages).

    Returns:
        A state dict for ``optimizer.load_state_dict``.

    Raises:
        CheckpointError: ``optimizer`` has several parts, or the checkpoint is not the
            portable engine's layout.
    """
    inners = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    if len(inners) != 1:
        raise CheckpointError(
            f"{path} holds the portable engine's optimizer state (one optimizer over all "
            f"parameters); this run's optimizer has {len(inners)} parts (expert parameters "
            "get their own): set checkpoint.load_optim=False to load the model, scheduler "
            "and train state and start the optimizer afresh"
        )
    inner = inners[0]
    saved = loaded.get("optimizer")
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict):
        raise CheckpointError(
            f"{path} says its optimizer state was saved by the portable engine, but it has "
            "no 'optimizer' entry of that layout; the checkpoint is damaged or was written "
            "by other software"
        )
    mixed_precision = hasattr(inner, "fp32_from_float16_groups")
    # The per-parameter tensors sit where this optimizer's template put them: beside the
    # saved torch state (FP32Optimizer) or inside it (mixed precision, same nesting).
    placed = saved["state"] if mixed_precision else loaded.get("state", {})
    state: dict[Any, Any] = {k: v for k, v in placed.items() if k != "common_step"}
    if "common_step" in saved["state"]:
        state["common_step"] = saved["state"]["common_step"]
    torch_state = {
        "state": state,
        # This optimizer's own groups: its parameter numbering is the one the template's
        # tensors are keyed by; hyperparameters are the config's (lr/wd: the scheduler's).
        "param_groups": inner.optimizer.state_dict()["param_groups"],
    }
    if not mixed_precision:
        return torch_state
    converted: dict[str, Any] = {
        "optimizer": torch_state,
        "fp32_from_fp16_params": loaded["fp32_from_fp16_params"],
    }
    if loaded.get("grad_scaler") is not None:
        converted["grad_scaler"] = loaded["grad_scaler"]
    return converted
