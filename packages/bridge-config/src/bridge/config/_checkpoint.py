"""The checkpoint section: where and how checkpoints are saved and loaded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from bridge.config._checks import at_least
from bridge.config._codec import normalize_fields
from bridge.config._errors import field_error, section_error
from bridge.config._section import config_section


@config_section
@dataclass(kw_only=True)
class CheckpointConfig:
    """Configuration settings for model checkpointing (saving and loading)."""

    save: str | None = None
    """Directory checkpoints are saved to (unset: never save)."""

    save_interval: int | None = None
    """Save a persistent checkpoint every this many iterations."""

    save_optim: bool = True
    """Include the optimizer state in saved checkpoints (set false to leave it out)."""

    save_rng: bool = True
    """Include the random-number-generator state in saved checkpoints (set false to leave it
    out)."""

    load: str | None = None
    """Directory to resume from (its latest checkpoint, or ``ckpt_step``)."""

    load_optim: bool = True
    """Restore the optimizer state when loading (set false to skip it)."""

    load_main_params_from_ckpt: bool = False
    """Also restore the optimizer's main (fp32) copy of the parameters from the checkpoint
    when the optimizer state is not loaded; needs ``load_optim`` false."""

    load_rng: bool = True
    """Restore the random-number-generator state when loading (set false to skip it)."""

    non_persistent_save_interval: int | None = None
    """Save a non-persistent checkpoint every this many iterations (needs
    ``non_persistent_ckpt_type``)."""

    non_persistent_ckpt_type: Literal["global", "local", "in_memory", None] | None = None
    """Kind of non-persistent checkpoint: ``"global"`` is a normal checkpoint in shared
    storage where only the newest is kept; ``"local"`` has each rank save its part to local
    storage; ``"in_memory"`` keeps it in memory without serialising. Unset (``null`` in
    YAML): no non-persistent checkpoints."""

    non_persistent_global_ckpt_dir: str | None = None
    """Directory of global non-persistent checkpoints (default: under ``save``)."""

    non_persistent_local_ckpt_dir: str | None = None
    """Directory of local non-persistent checkpoints (required for type ``"local"``)."""

    non_persistent_local_ckpt_algo: Literal["fully_parallel", "atomic"] = "fully_parallel"
    """Algorithm used to save local non-persistent checkpoints."""

    finetune: bool = False
    """Load the model weights only (no optimizer or random state) and restart at iteration
    0. Needs ``load`` or ``pretrained_checkpoint``. Assumed for release checkpoints."""

    pretrained_checkpoint: str | None = None
    """Directory of a pretrained checkpoint to start finetuning from."""

    ckpt_step: int | None = None
    """Load the checkpoint of this iteration instead of the latest."""

    use_checkpoint_args: bool = False
    """Replace configured values with those stored in the checkpoint."""

    exit_on_missing_checkpoint: bool = False
    """When ``load`` is set but holds no checkpoint (e.g. a typo), stop instead of training
    from a random initialisation."""

    resume_with_changes: bool = False
    """Resume the checkpoint in ``load`` (or ``save``) although this run's data, tokenizer or
    PEFT settings differ from those it was saved with. Without it such a resume is refused
    (the differences are listed): it would continue that run, at its point of the
    learning-rate schedule, as if nothing had changed. The model architecture must match in
    any case; to start a new run from the weights use ``pretrained_checkpoint`` or
    ``finetune``."""

    ckpt_format: Literal["torch_dist", "zarr"] = "torch_dist"
    """On-disk format of distributed checkpoints."""

    ckpt_convert_format: Literal["torch", "torch_dist", "zarr"] | None = None
    """Format to convert a loaded checkpoint to."""

    ckpt_convert_save: str | None = None
    """Directory the converted checkpoint is saved to."""

    fully_parallel_save: bool = True
    """Spread the saving work across data-parallel ranks (may reduce the number of files;
    makes a distributed-optimizer checkpoint non-reshardable)."""

    async_save: bool = False
    """Save checkpoints in the background while training continues. Only with
    ``ckpt_format`` ``"torch_dist"``; needs ``save``."""

    use_persistent_ckpt_worker: bool = True
    """Keep one background worker for asynchronous saves instead of starting a new one for
    each save."""

    fully_parallel_load: bool = False
    """Spread the loading work across data-parallel ranks."""

    ckpt_assume_constant_structure: bool = False
    """Promise that the model and optimizer state structure does not change during one run,
    which allows caching in checkpoint saves."""

    dist_ckpt_strictness: Literal[
        "assume_ok_unexpected",
        "log_unexpected",
        "log_all",
        "raise_unexpected",
        "raise_all",
        "return_unexpected",
        "return_all",
        "ignore_all",
    ] = "assume_ok_unexpected"
    """What to do about keys that do not match between a distributed checkpoint and the
    model when loading from storage (megatron-core's ``StrictHandling`` values). Does not
    affect loading a state dict into the model."""

    replication: bool = False
    """Replicate local checkpoints to other ranks; must be set on every rank."""

    replication_jump: int | None = None
    """Distance ``J`` between ranks holding replicas of one rank's data: replicas of rank
    ``n`` live on ``n + J``, ``n + 2J``, ... (same on every rank; only with ``replication``)."""

    replication_factor: int = 2
    """Number of machines that hold a replica of each rank's data."""

    def __post_init__(self) -> None:
        """Check the field types, intervals, async save and non-persistent checkpoint settings."""
        normalize_fields(self)
        for name in ("save_interval", "non_persistent_save_interval", "replication_jump"):
            at_least(self, name, 1)
        at_least(self, "ckpt_step", 0)
        at_least(self, "replication_factor", 1, allow_none=False)
        if self.load_main_params_from_ckpt and self.load_optim:
            raise section_error(
                self,
                "load_main_params_from_ckpt needs load_optim=False (the optimizer state already holds them)",
            )
        if self.async_save:
            if self.ckpt_format != "torch_dist":
                raise field_error(
                    self,
                    "async_save",
                    True,
                    f"it works only with ckpt_format 'torch_dist', not {self.ckpt_format!r}",
                )
            if self.save is None:
                raise field_error(
                    self, "async_save", True, "it needs save (the checkpoint directory) to be set"
                )
        kind = self.non_persistent_ckpt_type
        if self.non_persistent_save_interval is not None and kind is None:
            raise field_error(
                self,
                "non_persistent_save_interval",
                self.non_persistent_save_interval,
                "it needs non_persistent_ckpt_type ('global', 'local' or 'in_memory')",
            )
        if kind == "global" and self.non_persistent_global_ckpt_dir is None and self.save is None:
            raise field_error(
                self,
                "non_persistent_global_ckpt_dir",
                None,
                "non_persistent_ckpt_type 'global' needs this directory or save to be set",
            )
        if kind == "local" and self.non_persistent_local_ckpt_dir is None:
            raise field_error(
                self,
                "non_persistent_local_ckpt_dir",
                None,
                "non_persistent_ckpt_type 'local' needs this directory",
            )
        if self.replication and kind != "local":
            raise field_error(
                self,
                "replication",
                True,
                "replication applies to local checkpoints; set non_persistent_ckpt_type='local'",
            )
        if self.finetune and self.load is None and self.pretrained_checkpoint is None:
            raise field_error(
                self,
                "finetune",
                True,
                "it needs a checkpoint to start from: set load or pretrained_checkpoint",
            )
