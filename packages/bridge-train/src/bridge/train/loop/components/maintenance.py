"""Per-step upkeep components: device synchronisation, the weight-hash check across
data-parallel replicas, and manual garbage collection.

The functions are the single implementation of each; the components call them every step
and :func:`bridge.train.post_training_step_callbacks` (the reference's function) calls them
too.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any

import torch

from bridge.train.loop.forward_pre_hooks import (
    disable_forward_pre_hook,
    enable_forward_pre_hook,
)
from core_utils import check_param_hashes_across_dp_replicas
from core_utils.callbacks import Callback

if TYPE_CHECKING:
    from core_utils.loop import LoopContext

__all__ = [
    "DeviceSync",
    "GarbageCollection",
    "WeightHashCheck",
    "WeightHashMismatchError",
    "check_weight_hash",
    "collect_garbage",
    "synchronize_device",
]


class WeightHashMismatchError(RuntimeError):
    """Data-parallel replicas hold different weights (``check_weight_hash_...``)."""


def synchronize_device(interval: int | None, iteration: int) -> None:
    """Wait for the device every ``interval`` iterations (``train.train_sync_interval``)."""
    if interval and iteration % interval == 0 and torch.cuda.is_available():
        torch.cuda.synchronize()


def check_weight_hash(
    model: list[Any], interval: int | None, iteration: int, toggle_forward_pre_hooks: bool
) -> None:
    """Compare parameter hashes across data-parallel replicas every ``interval`` iterations.

    A collective on those iterations. Forward pre-hooks are toggled around it when an
    overlapped parameter gather could still be filling the parameters.

    Raises:
        WeightHashMismatchError: The weights differ across replicas.
    """
    if not interval or iteration % interval != 0:
        return

    if toggle_forward_pre_hooks:
        disable_forward_pre_hook(model)
    matching = check_param_hashes_across_dp_replicas(model, cross_check=True)
    if toggle_forward_pre_hooks:
        enable_forward_pre_hook(model)
    if not matching:
        raise WeightHashMismatchError(
            f"iteration {iteration}: the model weights differ across data-parallel "
            "replicas (the differing parameters are logged above); training stopped. "
            "Check for non-deterministic updates or a faulty rank, and resume from the "
            "last checkpoint (train.check_weight_hash_across_dp_replicas_interval)"
        )


def collect_garbage(manual_gc: bool, interval: int | None, iteration: int) -> None:
    """Run the garbage collector every ``interval`` iterations when ``manual_gc`` is on."""
    if manual_gc and interval and iteration % interval == 0:
        gc.collect()


def _completed(context: LoopContext) -> bool:
    result = context.step_result
    return result is not None and result.completed


class DeviceSync(Callback):
    """``torch.cuda.synchronize()`` every ``train.train_sync_interval`` iterations."""

    def __init__(self, interval: int | None) -> None:
        self.interval = interval

    def on_step_end(self, context: LoopContext) -> None:
        """Synchronise on the interval."""
        if _completed(context):
            synchronize_device(self.interval, context.iteration)


class WeightHashCheck(Callback):
    """Checks that data-parallel replicas hold identical weights every ``interval`` steps.

    Args:
        interval: ``train.check_weight_hash_across_dp_replicas_interval``.
        toggle_forward_pre_hooks: Disable forward pre-hooks around the check.
    """

    def __init__(self, interval: int, toggle_forward_pre_hooks: bool) -> None:
        self.interval = interval
        self.toggle = toggle_forward_pre_hooks

    def on_step_end(self, context: LoopContext) -> None:
        """Check on the interval (raises :class:`WeightHashMismatchError`)."""
        if _completed(context):
            check_weight_hash(context.model, self.interval, context.iteration, self.toggle)


class GarbageCollection(Callback):
    """Manual garbage collection (``train.manual_gc``): automatic collection is off during
    training and every rank collects at the same iterations (``manual_gc_interval``)."""

    def __init__(self, interval: int | None) -> None:
        self.interval = interval
        self._was_enabled: bool | None = None

    def on_train_start(self, context: LoopContext) -> None:
        """Turn automatic collection off and start from a clean heap."""
        self._was_enabled = gc.isenabled()
        gc.disable()
        gc.collect()

    def on_step_end(self, context: LoopContext) -> None:
        """Collect on the interval."""
        if _completed(context):
            collect_garbage(True, self.interval, context.iteration)

    def close(self) -> None:
        """Restore automatic collection (idempotent; also after an error)."""
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None
