"""Adapter-only checkpoints of a PEFT model, and loading base + adapters.

After :func:`~bridge.train.peft.base.apply_peft`, a chunk's ``sharded_state_dict`` holds
its adapter tensors only (so every checkpoint the run saves is adapter-only, with the
optimizer state of the adapters, the scheduler, RNG and train state as usual), and its
``load_state_dict`` accepts a state without base tensors. :func:`load_peft_checkpoints`
loads, in order: the base weights from ``checkpoint.pretrained_checkpoint`` (model only,
every base tensor required and checked for shape), then, when the run resumes
(``checkpoint.load``, or an earlier run's checkpoint in ``checkpoint.save``), the adapters,
optimizer, scheduler, RNG and train state from that adapter-only checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from megatron.core.dist_checkpointing import load_tensors_metadata

from bridge.config import CheckpointConfig, ModelConfigProtocol
from bridge.train.checkpointing import find_latest_checkpoint, restore_checkpoint
from core_utils.model_wrapping import get_attr_wrapped_model

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from bridge.train.state import TrainState

__all__ = ["install_adapter_checkpointing", "load_peft_checkpoints", "peft_checkpoint_mode"]

_MODE_ATTR = "_bridge_peft_checkpoint_mode"
_AVAILABLE_ATTR = "_bridge_peft_base_keys"


def install_adapter_checkpointing(chunk: torch.nn.Module, adapter_names: frozenset[str]) -> None:
    """Make ``chunk``'s state dicts adapter-only (or base-only inside
    :func:`peft_checkpoint_mode`); see the module docstring."""
    setattr(chunk, _MODE_ATTR, "adapters")
    cls = type(chunk)
    # Modules holding adapter parameters only: their non-parameter state (megatron's
    # ``_extra_state``) belongs to the adapters too.
    adapter_modules = {
        name
        for name, module in chunk.named_modules()
        if name
        and (params := [f"{name}.{p}" for p, _ in module.named_parameters()])
        and all(p in adapter_names for p in params)
    }

    def is_adapter(key: str) -> bool:
        return key in adapter_names or key.rpartition(".")[0] in adapter_modules

    def sharded_state_dict(
        prefix: str = "", sharded_offsets: tuple[Any, ...] = (), metadata: Any = None
    ) -> dict[str, Any]:
        full = cls.sharded_state_dict(chunk, prefix, sharded_offsets, metadata)  # type: ignore[attr-defined]
        if getattr(chunk, _MODE_ATTR) == "adapters":
            return {k: v for k, v in full.items() if is_adapter(k.removeprefix(prefix))}
        # Base: every base tensor, and those adapter tensors the base checkpoint holds (a
        # transform may train parameters the base has, such as norms).
        available: frozenset[str] = getattr(chunk, _AVAILABLE_ATTR, frozenset())
        return {
            k: v
            for k, v in full.items()
            if not is_adapter(k.removeprefix(prefix)) or getattr(v, "key", None) in available
        }

    def load_state_dict(state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        result = cls.load_state_dict(chunk, state_dict, strict=False, assign=assign)
        if strict:
            want_adapters = getattr(chunk, _MODE_ATTR) == "adapters"
            missing = [
                k
                for k in result.missing_keys
                if is_adapter(k) == want_adapters and not k.endswith("_extra_state")
            ]
            if missing or result.unexpected_keys:
                raise RuntimeError(
                    f"loading {'adapters' if want_adapters else 'the base model'}: missing "
                    f"{sorted(missing)[:5]}, unexpected {sorted(result.unexpected_keys)[:5]}"
                )
        return result

    # Instance attributes shadow the class's methods for this chunk only.
    setattr(chunk, "sharded_state_dict", sharded_state_dict)  # noqa: B010
    setattr(chunk, "load_state_dict", load_state_dict)  # noqa: B010


@contextlib.contextmanager
def peft_checkpoint_mode(
    model: list[torch.nn.Module], mode: str, base_keys: frozenset[str] = frozenset()
) -> Iterator[None]:
    """Within the block, state dicts of PEFT chunks hold ``"base"`` or ``"adapters"``.

    Args:
        model: Model chunks.
        mode: ``"base"`` or ``"adapters"``.
        base_keys: In ``"base"`` mode, the checkpoint keys of the base checkpoint: adapter
            parameters found there are loaded with the base.
    """
    chunks = []
    for chunk in model:
        with contextlib.suppress(RuntimeError):  # a chunk without adapters
            chunks.append(get_attr_wrapped_model(chunk, _MODE_ATTR, return_model_obj=True))
    previous = [getattr(c, _MODE_ATTR) for c in chunks]
    for chunk in chunks:
        setattr(chunk, _MODE_ATTR, mode)
        setattr(chunk, _AVAILABLE_ATTR, base_keys)
    try:
        yield
    finally:
        for chunk, old in zip(chunks, previous, strict=True):
            setattr(chunk, _MODE_ATTR, old)
            del chunk.__dict__[_AVAILABLE_ATTR]  # only this block reads the base keys


def load_peft_checkpoints(
    checkpoint: CheckpointConfig,
    train_state: TrainState,
    model: list[torch.nn.Module],
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    checkpointing_context: dict[str, Any],
    *,
    model_config: ModelConfigProtocol | None = None,
    reseed: Callable[[int], int] | None = None,
) -> tuple[int, float]:
    """Load the base from ``pretrained_checkpoint``, then resume adapters if there are any.

    ``checkpoint.load`` names the run to resume (``None``: start adapters afresh at
    iteration 0).

    Args:
        checkpoint: The ``checkpoint`` section.
        train_state: The run's counters (restored with the adapters).
        model: Model chunks with the adapters applied.
        optimizer: The optimizer, or None.
        scheduler: The scheduler, or None.
        checkpointing_context: From ``init_checkpointing_context``.
        model_config: The run's model config: a checkpoint of another architecture is
            refused when resuming (``None``: not checked).
        reseed: ``restore_checkpoint``'s: reseeds the generators after a resume under
            another parallel layout.

    Returns:
        ``(iteration, floating_point_operations_so_far)`` of the resumed run, else ``(0, 0.0)``.

    Raises:
        bridge.train.checkpointing.CheckpointError: The base checkpoint lacks a tensor of
            the model or holds one of another shape (another architecture).
    """
    base = find_latest_checkpoint(checkpoint.pretrained_checkpoint)
    base_keys = frozenset(load_tensors_metadata(base.path)) if base is not None else frozenset()
    restore = functools.partial(
        restore_checkpoint,
        train_state=train_state,
        model=model,
        optimizer=optimizer,
        opt_param_scheduler=scheduler,
        model_config=model_config,
        checkpointing_context=checkpointing_context,
        reseed=reseed,
    )
    # Each load reads a copy of the section naming only its checkpoint (the run's is kept).
    base_only = copy.copy(checkpoint)
    base_only.load = None
    base_only.ckpt_step = None
    base_only.non_persistent_ckpt_type = None
    with peft_checkpoint_mode(model, "base", base_keys):
        restore(base_only)
    if checkpoint.load is None:
        return 0, 0.0
    adapters_only = copy.copy(checkpoint)
    adapters_only.pretrained_checkpoint = None
    with peft_checkpoint_mode(model, "adapters"):
        return restore(adapters_only)
