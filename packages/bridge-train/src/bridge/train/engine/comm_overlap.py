"""Communication-overlap settings chosen for the parallel layout (``ConfigContainer.comm_overlap``).

The overlap switches live in three sections: pipeline point-to-point modes and embedding
weight-gradient deferral in ``model``, gradient-reduce / parameter-gather overlap and bucket
size in ``ddp``, and the optimizer-step overlap of the parameter gather in ``optimizer``.
:class:`CommOverlapConfig` is one place to ask for them: ``ConfigContainer.validate()`` calls
:meth:`CommOverlapConfig.setup`, which writes into those sections

* every field given here (not ``None``), and
* for a field left ``None``, the value that suits the layout (the defaults Megatron-Bridge
  users know: batched p2p without a virtual pipeline, overlapped p2p with one; with the
  distributed optimizer and more than one data-parallel replica, overlapped gradient
  reduce-scatter and parameter all-gather in 128 MiB buckets, aligned over virtual
  pipeline stages) — but only where the section still holds its own default, so a value the
  user set in the section is kept.

A field given here that contradicts a value the user set in the section is refused, naming
both, rather than one silently winning. Tensor-parallel overlap (Transformer Engine
userbuffers) is refused: bridge-train does not initialise userbuffers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from bridge.config import (
    ConfigError,
    DDPConfigProtocol,
    ModelConfigProtocol,
    OptimizerConfigProtocol,
)

__all__ = ["CommOverlapConfig"]

_BUCKET_BYTES = 128 * 1024 * 1024

# field -> the section it belongs to
_TARGETS: dict[str, str] = {
    "overlap_p2p_comm": "model",
    "batch_p2p_comm": "model",
    "defer_embedding_wgrad_compute": "model",
    "wgrad_deferral_limit": "model",
    "overlap_grad_reduce": "ddp",
    "overlap_param_gather": "ddp",
    "align_param_gather": "ddp",
    "bucket_size": "ddp",
    "overlap_param_gather_with_optimizer_step": "optimizer",
}


@dataclasses.dataclass(kw_only=True)
class CommOverlapConfig:
    """Communication overlap for tensor, pipeline and data parallelism.

    ``None`` means "choose for the layout" (see the module docstring).
    """

    tp_comm_overlap: bool = False
    """Tensor-parallel communication overlap with Transformer Engine userbuffers (refused when
    true: the trainer does not initialise userbuffers)."""

    overlap_p2p_comm: bool | None = None
    """Overlap pipeline send/receive with compute (interleaved schedule only)."""

    batch_p2p_comm: bool | None = None
    """Batch pipeline send/receive into one ``batch_isend_irecv`` call."""

    overlap_grad_reduce: bool | None = None
    """Overlap the data-parallel gradient reduce(-scatter) with the backward pass."""

    overlap_param_gather: bool | None = None
    """Overlap the distributed optimizer's parameter all-gather with the forward pass."""

    overlap_param_gather_with_optimizer_step: bool | None = None
    """Start the parameter all-gather inside the optimizer step (interleaved pipeline)."""

    align_param_gather: bool | None = None
    """Launch the parameter all-gathers of all virtual pipeline stages together."""

    bucket_size: int | None = None
    """Elements per gradient-reduction bucket."""

    defer_embedding_wgrad_compute: bool | None = None
    """Defer the output-embedding weight-gradient GEMMs into the pipeline flush."""

    wgrad_deferral_limit: int | None = None
    """How many micro-batches' embedding weight gradients may be deferred (0: all)."""

    data_parallel_size: int | None = None
    """Derived by ``ConfigContainer.validate()``; leave unset."""

    def __post_init__(self) -> None:
        if self.tp_comm_overlap:
            raise ConfigError(
                "comm_overlap.tp_comm_overlap",
                "got true; tensor-parallel overlap needs Transformer Engine userbuffers, which "
                "bridge-train does not initialise; set comm_overlap.tp_comm_overlap=false",
            )
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ConfigError(
                "comm_overlap.bucket_size", f"got {self.bucket_size}; use a positive size"
            )
        if self.wgrad_deferral_limit is not None and self.wgrad_deferral_limit < 0:
            raise ConfigError(
                "comm_overlap.wgrad_deferral_limit",
                f"got {self.wgrad_deferral_limit}; use 0 (no limit) or a positive count",
            )

    def setup(
        self,
        model: ModelConfigProtocol | None,
        optimizer: OptimizerConfigProtocol | None,
        ddp: DDPConfigProtocol | None,
    ) -> None:
        """Write the overlap settings into the ``model``, ``optimizer`` and ``ddp`` sections.

        Args:
            model: The model config.
            optimizer: The optimizer config.
            ddp: The ``ddp`` section.

        Raises:
            ConfigError: A field set here contradicts a value the user set in its section.
        """
        distributed_optimizer = bool(getattr(ddp, "use_distributed_optimizer", False))
        if self.overlap_param_gather and not distributed_optimizer:
            raise ConfigError(
                "comm_overlap.overlap_param_gather",
                "got true; the parameter all-gather exists only with the distributed "
                "optimizer: set ddp.use_distributed_optimizer=true or unset this field",
            )
        virtual = int(getattr(model, "virtual_pipeline_model_parallel_size", None) or 1)
        pipeline = int(getattr(model, "pipeline_model_parallel_size", 1) or 1)
        sharded = distributed_optimizer and int(self.data_parallel_size or 1) > 1
        # The layout's choice for a field left None (None: the layout has none).
        chosen: dict[str, Any] = {
            "overlap_p2p_comm": pipeline > 1 and virtual > 1,
            "batch_p2p_comm": pipeline > 1 and virtual == 1,
            "overlap_grad_reduce": True if sharded else None,
            "overlap_param_gather": True if sharded else None,
            "align_param_gather": True if sharded and pipeline > 1 and virtual > 1 else None,
            "bucket_size": _BUCKET_BYTES if sharded else None,
        }
        sections = {"model": model, "optimizer": optimizer, "ddp": ddp}
        for name, section in _TARGETS.items():
            target, given = sections[section], getattr(self, name)
            value = chosen.get(name) if given is None else given
            if target is None or not hasattr(target, name):
                if given is not None:
                    raise ConfigError(
                        f"comm_overlap.{name}",
                        f"got {given!r} but the {section} section "
                        f"({type(target).__name__}) has no field {name!r}; unset it",
                    )
                continue
            current = getattr(target, name)
            if value is None or current == value:
                continue
            if current != _field_default(target, name):
                if given is not None:
                    raise ConfigError(
                        f"comm_overlap.{name}",
                        f"got {value!r} but {section}.{name} is {current!r}; set only "
                        "one of them, or make them equal",
                    )
                continue  # the user's value in the section wins over the layout's choice
            setattr(target, name, value)


def _field_default(obj: Any, name: str) -> Any:
    for field in dataclasses.fields(obj) if dataclasses.is_dataclass(obj) else ():
        if field.name == name:
            if field.default is not dataclasses.MISSING:
                return field.default
            if field.default_factory is not dataclasses.MISSING:
                return field.default_factory()
    return None
