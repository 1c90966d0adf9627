"""Forward pre-hooks of megatron's DDP around saves, evaluation and weight checks.

With the distributed optimizer and an overlapped parameter gather, megatron DDP gathers a
bucket's parameters in the forward pre-hook of the next forward; anything that reads whole
parameters between two steps (a save, an evaluation, a weight-hash check) disables the hooks
first (finishing the pending gather) and enables them afterwards.
"""

from __future__ import annotations

from typing import Any

from bridge.config import DDPConfigProtocol, OptimizerConfigProtocol

__all__ = [
    "disable_forward_pre_hook",
    "enable_forward_pre_hook",
    "should_disable_forward_pre_hook",
    "should_toggle_forward_pre_hook",
]


def should_disable_forward_pre_hook(
    use_megatron_fsdp: bool, use_distributed_optimizer: bool, overlap_param_gather: bool
) -> bool:
    """Determine if forward pre-hooks should be disabled during checkpointing.

    Forward pre-hooks need to be disabled during checkpoint saving when using distributed
    optimizer with overlapped parameter gathering (megatron DDP gathers a bucket's parameters
    in the hook of the next forward; a save in between must see complete parameters).

    Args:
        use_megatron_fsdp: Whether Megatron FSDP is enabled.
        use_distributed_optimizer: Whether distributed optimizer is enabled.
        overlap_param_gather: Whether parameter gathering is overlapped.

    Returns:
        True if forward pre-hooks should be disabled, False otherwise.
    """
    return bool(not use_megatron_fsdp and use_distributed_optimizer and overlap_param_gather)


def enable_forward_pre_hook(model: list[Any]) -> None:
    """Enable forward pre-hook for all model chunks.

    Chunks without forward pre-hooks (plain modules, chunks not wrapped in megatron's DDP)
    are left as they are.

    Args:
        model: list of model chunks wrapped in DDP
    """
    for chunk in model:
        enable = getattr(chunk, "enable_forward_pre_hook", None)
        if enable is not None:
            enable()


def disable_forward_pre_hook(model: list[Any], param_sync: bool = True) -> None:
    """Disable forward pre-hook for all model chunks.

    Chunks without forward pre-hooks (plain modules, chunks not wrapped in megatron's DDP)
    are left as they are.

    Args:
        model: list of model chunks wrapped in DDP
        param_sync: Whether to synchronize parameters across model chunks (finish the
            pending overlapped parameter all-gather first)
    """
    for chunk in model:
        disable = getattr(chunk, "disable_forward_pre_hook", None)
        if disable is not None:
            disable(param_sync=param_sync)


def should_toggle_forward_pre_hook(
    ddp_config: DDPConfigProtocol | None, optimizer_config: OptimizerConfigProtocol | None
) -> bool:
    """Whether the ``ddp`` and ``optimizer`` sections need the hooks toggled around
    whole-parameter reads (see :func:`should_disable_forward_pre_hook`)."""
    return should_disable_forward_pre_hook(
        bool(getattr(ddp_config, "use_megatron_fsdp", False)),
        bool(getattr(optimizer_config, "use_distributed_optimizer", False)),
        bool(getattr(ddp_config, "overlap_param_gather", False)),
    )
