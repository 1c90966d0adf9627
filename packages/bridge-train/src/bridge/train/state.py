"""Training state: the counters a run advances and a checkpoint restores.

:class:`TrainState` holds the progress of one run (iteration, consumed samples, FLOPs) and
round-trips through ``state_dict`` / ``load_state_dict`` as tensors, so it can be saved with
``torch.save``, ``torch.distributed.checkpoint`` or megatron's dist_checkpointing.

:class:`GlobalState` is the object a forward-step function can ask for (by annotating a
parameter with it, or naming the first parameter ``state``; see
:func:`bridge.train.needs_global_state_injection`). It carries the config, the
:class:`TrainState`, the timers and the start time of the job. The training loop extends it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Any

import torch

__all__ = ["GlobalState", "TrainState"]

# dtype each TrainState field is stored with in a state dict.
_FIELD_DTYPES: dict[str, torch.dtype] = {
    "step": torch.int64,
    "consumed_train_samples": torch.int64,
    "skipped_train_samples": torch.int64,
    "consumed_valid_samples": torch.int64,
    "floating_point_operations_so_far": torch.float64,
    "do_train": torch.bool,
    "do_valid": torch.bool,
    "do_test": torch.bool,
}


@dataclass
class TrainState:
    """Progress of a training run.

    Attributes:
        step: Number of completed training iterations.
        consumed_train_samples: Training samples consumed so far (over all data-parallel
            ranks); the data sampler resumes from here.
        skipped_train_samples: Samples of iterations whose update was skipped (for example
            non-finite gradients under fp16 loss scaling).
        consumed_valid_samples: Validation samples consumed so far.
        floating_point_operations_so_far: Model FLOPs executed so far (see
            :func:`bridge.train.num_floating_point_operations`).
        do_train: Whether a training dataset exists.
        do_valid: Whether a validation dataset exists.
        do_test: Whether a test dataset exists.
    """

    step: int = 0
    consumed_train_samples: int = 0
    skipped_train_samples: int = 0
    consumed_valid_samples: int = 0
    floating_point_operations_so_far: float = 0.0
    do_train: bool = False
    do_valid: bool = False
    do_test: bool = False

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Return every field as a 0-d CPU tensor (int64 counters, float64 FLOPs, bool flags).

        Returns:
            A dict keyed by field name.
        """
        return {
            f.name: torch.tensor(getattr(self, f.name), dtype=_FIELD_DTYPES[f.name])
            for f in fields(self)
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the fields from ``state_dict`` (tensors or plain Python numbers).

        Args:
            state_dict: A dict as returned by :meth:`state_dict`.

        Raises:
            KeyError: A field is missing; the message names it.
        """
        missing = [f.name for f in fields(self) if f.name not in state_dict]
        if missing:
            raise KeyError(
                f"TrainState.load_state_dict: missing {missing}; the state dict has "
                f"{sorted(state_dict)}"
            )
        for f in fields(self):
            value = state_dict[f.name]
            if isinstance(value, torch.Tensor):
                value = value.item()
            if _FIELD_DTYPES[f.name] is torch.bool:
                value = bool(value)
            elif _FIELD_DTYPES[f.name] is torch.float64:
                value = float(value)
            else:
                value = int(value)
            setattr(self, f.name, value)


@dataclass
class GlobalState:
    """State shared by the training loop and forward-step functions.

    Attributes:
        cfg: The run's configuration (a ``bridge.config.ConfigContainer``), or ``None``.
        train_state: Progress counters of the run.
        timers: The run's timers (``core_utils.Timers``), set by the training loop.
        start_time: Wall-clock time (``time.time()``) at which the job started.
    """

    cfg: Any = None
    train_state: TrainState = field(default_factory=TrainState)
    timers: Any = None
    start_time: float = field(default_factory=time.time)
