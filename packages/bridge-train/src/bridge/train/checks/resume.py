"""What a run will resume, said before it starts: a changed run refused, a run with nothing
left to train and an unused ``pretrained_checkpoint`` named.

A run resumes the newest checkpoint of ``checkpoint.load``, or of ``checkpoint.save`` when
``load`` is unset and that directory holds one (so re-running a command continues it).
Three ways this looked like success while doing something else:

* **A changed run.** An example script with a fixed save directory, run on a new corpus,
  continued the earlier run on the new data at the end of its learning-rate schedule.
  :func:`resume_matches_run` compares the data, tokenizer and PEFT settings with the run config
  saved in the checkpoint and refuses a difference, listing each field, unless
  ``checkpoint.resume_with_changes`` is set (then the differences are only listed). The
  model architecture is compared too (:mod:`bridge.train.checkpointing.architecture`,
  which the load itself repeats); how the data is read (workers, caches, layout-derived
  sizes) may change freely. A run that only evaluates (``train.skip_train``, as
  ``--eval-only`` sets) continues nothing, so only the architecture is compared.
* **Nothing to train.** A checkpoint at or past ``train.train_iters`` only evaluates.
* **An unused pretrained checkpoint.** ``checkpoint.pretrained_checkpoint`` is loaded only
  when there is nothing to resume; with a checkpoint in the save directory the resume wins.

:func:`run_plan_notices` gives the one-line notices of the last two (``bridge-train
--dry-run`` prints them; ``pretrain`` logs them on rank 0 once the checkpoint is loaded).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path
from typing import Any

from bridge.config import (
    CheckpointConfig,
    ConfigContainer,
    ConfigError,
    FinetuningDatasetConfig,
    GPTDatasetConfig,
    ModelConfigProtocol,
    PEFTProtocol,
    TokenizerConfig,
    TokenizerConfigProtocol,
    TrainingConfig,
)
from bridge.train.checkpointing import CheckpointError
from bridge.train.checkpointing.architecture import (
    check_same_architecture,
    differences,
    read_run_config,
)
from bridge.train.checkpointing.layout import once_per_launch
from bridge.train.checkpointing.load import PlannedLoad, planned_load

__all__ = [
    "IDENTITY_SECTIONS",
    "LOADER_FIELDS",
    "resume_matches_run",
    "run_plan_notices",
]

logger = logging.getLogger(__name__)

#: Sections that say what a run trains on; a resume must not change them silently.
IDENTITY_SECTIONS: tuple[str, ...] = ("dataset", "tokenizer", "peft")

#: Dataset fields about how the data is read, not which data: free to change on a resume.
LOADER_FIELDS: frozenset[str] = frozenset(
    {
        "dataloader_type",
        "num_workers",
        "pin_memory",
        "persistent_workers",
        "data_sharding",
        "path_to_cache",
        "mmap_bin_files",
        "num_dataset_builder_threads",
        "fast_cache_load",
        "defer_npy_index_mmap",
        "object_storage_cache_path",
        "memmap_workers",
        # Set from the parallel layout, which a resume may change.
        "data_parallel_size",
        "sequence_parallel_size",
        "context_parallel_size",
    }
)


def _planned_resume(checkpoint: CheckpointConfig | None) -> PlannedLoad | None:
    # None also when the run starts from pretrained weights, or the choice cannot be made
    # before the launch (the load itself reports why).
    if checkpoint is None or (checkpoint.load is None and checkpoint.save is None):
        return None

    # loop imports the launch checks (pretrain): its module is imported when used.
    from bridge.train.loop.run_ends import adopt_own_save_dir

    probe = copy.copy(checkpoint)
    adopt_own_save_dir(probe)
    try:
        plan = planned_load(probe)
    except CheckpointError:
        return None
    return None if plan is None or plan.weights_only else plan


def _saved_run_config(path: str) -> ConfigContainer | None:
    # The launch check and --dry-run's notices compare the same file: read once per launch.
    return once_per_launch("run_config", path, None, lambda: read_run_config(path))


def _section_values(section: Any) -> dict[str, Any]:
    if section is None:
        return {}
    if not dataclasses.is_dataclass(section):
        return {"": section}
    target = f"{type(section).__module__}.{type(section).__qualname__}"
    return {"_target_": target} | {
        f.name: getattr(section, f.name)
        for f in dataclasses.fields(section)
        if f.init and not f.name.startswith("_") and f.name not in LOADER_FIELDS
    }


def _changed_sections(saved: Any, sections: dict[str, Any]) -> list[str]:
    changes = []
    for name in IDENTITY_SECTIONS:
        before = _section_values(getattr(saved, name, None))
        after = _section_values(sections.get(name))
        if before.get("_target_") != after.get("_target_"):
            changes.append(
                f"{name} (saved {before.get('_target_', 'none')}, "
                f"this run {after.get('_target_', 'none')})"
            )
            continue
        where = {key: f"{name}.{key}" if key else name for key in sorted(before | after)}
        changes += differences(
            {where[key]: before.get(key) for key in where},
            {where[key]: after.get(key) for key in where},
            "saved",
        )
    return changes


def resume_matches_run(
    checkpoint: CheckpointConfig,
    model: ModelConfigProtocol,
    dataset: GPTDatasetConfig | FinetuningDatasetConfig | None,
    tokenizer: TokenizerConfig | TokenizerConfigProtocol | None,
    peft: PEFTProtocol | None,
    train: TrainingConfig | None,
) -> None:
    """The checkpoint a resume would load was saved by this run (the launch checks'
    ``checkpoint`` rule): the same model architecture, and, for a run that trains, the same
    data, tokenizer and PEFT settings unless ``checkpoint.resume_with_changes`` is set.

    A run that only evaluates (``train.skip_train``) continues nothing of the saved run, so
    it may read other data (``--eval-only --eval-data`` does); only the architecture is
    compared then.

    Raises:
        ConfigError: The checkpoint to resume was saved with other data, tokenizer or PEFT
            settings (each listed) and ``checkpoint.resume_with_changes`` is not set.
        CheckpointError: It was saved from a model of another architecture.
    """
    plan = _planned_resume(checkpoint)
    if plan is None:
        return

    saved = _saved_run_config(plan.path)
    if saved is None:
        return
    check_same_architecture(model, plan.path, before_setup=True, saved_model=saved.model)
    if train is not None and train.skip_train:
        # Evaluation only (--eval-only, train.skip_train): no schedule or data position is
        # continued, so other data is the point, not a mistake; the weights must still fit.
        return
    changes = _changed_sections(saved, {"dataset": dataset, "tokenizer": tokenizer, "peft": peft})
    if changes and not checkpoint.resume_with_changes:
        raise ConfigError(
            "checkpoint.load" if checkpoint.load is not None else "checkpoint.save",
            f"would resume iteration {plan.iteration} of {plan.path}, which was saved by a "
            f"run with other settings: {'; '.join(changes)}. Resuming would continue that run "
            "(its learning-rate schedule, its data position) as if nothing had changed. Start "
            "a new run with a new checkpoint.save, start from its weights with "
            f"checkpoint.pretrained_checkpoint={Path(plan.path).parent}, or set "
            "checkpoint.resume_with_changes=true to continue it",
        )


def _is_within(path: str, directory: str) -> bool:
    return Path(path).resolve().is_relative_to(Path(directory).resolve())


def run_plan_notices(
    checkpoint: CheckpointConfig,
    train: TrainingConfig,
    identity: dict[str, Any],
    *,
    loaded: str | None = None,
    iteration: int = 0,
    done: bool = False,
    after_load: bool = False,
) -> list[str]:
    """One-line notices: a resume with changes, nothing to train, unused pretrained weights.

    Called before a launch (``--dry-run``: what the files say) or after the checkpoint was
    loaded (``pretrain``: what was loaded and where the run stands).

    Args:
        checkpoint: The run's ``checkpoint`` section (a required one).
        train: The run's ``train`` section (a required one).
        identity: This run's :data:`IDENTITY_SECTIONS` by name (what a resume compares).
        loaded: After the load: the checkpoint directory loaded, or None.
        iteration: After the load: the iteration the run starts at.
        done: After the load: whether the run has already reached its length.
        after_load: The other arguments describe a load that happened; otherwise the
            checkpoint this run would resume is read from the files.

    Returns:
        The notices, possibly none.
    """
    pretrained = checkpoint.pretrained_checkpoint
    if not after_load:
        plan = _planned_resume(checkpoint)
        if plan is None:
            return []
        loaded, iteration = plan.path, plan.iteration
        done = train.train_iters is not None and plan.iteration >= train.train_iters
    if loaded is None or checkpoint.finetune or (pretrained and _is_within(loaded, pretrained)):
        return []  # nothing resumed: a new run, from scratch or from pretrained weights
    notices = []
    if checkpoint.resume_with_changes:
        saved = _saved_run_config(loaded)
        changes = _changed_sections(saved, identity) if saved is not None else []
        if changes:
            notices.append(
                f"resuming iteration {iteration} of {loaded} with changed settings "
                f"(checkpoint.resume_with_changes): {'; '.join(changes)}"
            )
    if (
        pretrained is not None and identity.get("peft") is None
    ):  # PEFT reads its base from it anyway
        notices.append(
            f"checkpoint.pretrained_checkpoint={pretrained} is not used: this run resumes "
            f"iteration {iteration} of {loaded} (a checkpoint to resume comes first); for a new "
            "finetuning run from it, give a new checkpoint.save"
        )
    if done and not train.skip_train:
        field, value = (
            ("train.train_samples", train.train_samples)
            if train.train_samples is not None
            else ("train.train_iters", train.train_iters)
        )
        notices.append(
            f"nothing to train: the resumed checkpoint ({loaded}, iteration {iteration}) has "
            f"already reached {field}={value}, so this run only evaluates; raise {field} to "
            "train further, or give a new checkpoint.save for a new run"
        )
    return notices
