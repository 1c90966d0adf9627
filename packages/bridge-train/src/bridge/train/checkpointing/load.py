"""Loading a checkpoint: choose it, check it against the model, restore what was asked for.

Which checkpoint (decided on rank 0 and shared, so every rank loads the same one):

* ``checkpoint.load`` with ``ckpt_step``: that iteration (an error if it is not complete);
* ``checkpoint.load``: the iteration its tracker names (see
  :func:`~bridge.train.checkpointing.layout.find_latest_checkpoint` for the fallback when
  that directory is missing); with ``non_persistent_ckpt_type='global'`` the newer of it
  and the newest non-persistent checkpoint;
* otherwise ``checkpoint.pretrained_checkpoint`` (model weights only, as ``finetune``);
* otherwise nothing: ``(0, 0.0)``, or an error with ``exit_on_missing_checkpoint``.

What is restored: the model always; optimizer and scheduler with ``load_optim`` (and not
``finetune``; optimizer state of another format or number of parts is converted, see
:mod:`~bridge.train.checkpointing.optimizer_conversion`); this rank's RNG state with
``load_rng`` (and not ``finetune``, and only when the parallel layout matches the one saved:
the generators are per rank); the train state unless ``finetune`` (which restarts at
iteration 0).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing import load_common_state_dict, load_tensors_metadata
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
)
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from torch.distributed.checkpoint.api import CheckpointException

from bridge.config import CheckpointConfig, ModelConfigProtocol
from bridge.config.notices import held_notices, log_held_notices
from bridge.train.checkpointing.architecture import check_same_architecture
from bridge.train.checkpointing.context import (
    check_checkpoint_config,
    non_persistent_dir,
    required_checkpoint_section,
)
from bridge.train.checkpointing.errors import CheckpointError, run_on_rank0
from bridge.train.checkpointing.integrity import checkpoint_problems, gather_problems
from bridge.train.checkpointing.layout import (
    TRACKER_FILENAME,
    CheckpointLocation,
    find_latest_checkpoint,
    is_complete_checkpoint,
    older_complete,
    parse_iteration,
)
from bridge.train.checkpointing.optimizer_conversion import (
    OptimizerConversion,
    conversion_template,
)
from bridge.train.checkpointing.optimizer_load import check_scheduler_settings, load_optimizer
from bridge.train.checkpointing.rng import RNG_STATE_KEY, restore_rng_state
from bridge.train.checkpointing.state_dict import (
    FORMAT_VERSION,
    LAYOUT_SIZES,
    META_KEY,
    model_sharded_state_dict,
    model_state_keys,
    optimizer_format,
    optimizer_parts,
    optimizer_sharded_state_dict,
    parallel_layout,
    sharded_entries,
    unwrapped_chunks,
)
from bridge.train.engine.initialize import resume_seed
from core_utils.distributed import dist_ready, global_rank

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from bridge.train.state import GlobalState, TrainState

__all__ = [
    "PlannedLoad",
    "checkpoint_exists",
    "load_checkpoint",
    "planned_load",
    "restore_checkpoint",
]

logger = logging.getLogger(__name__)

# The template entry optimizer tensors of another format are loaded under (see
# optimizer_conversion): not "optimizer", whose saved common state has the other layout.
CONVERTED_OPTIMIZER_KEY = "bridge_converted_optimizer"


def checkpoint_exists(path: str | os.PathLike[str] | None) -> bool:
    """Whether ``path`` holds a checkpoint to resume from.

    True for a save directory with a tracker (``latest_checkpointed_iteration.txt``) or for
    a complete checkpoint directory (``iter_*`` with its completion marker).

    Args:
        path: A directory, or ``None`` (False).
    """
    if path is None:
        return False
    base = Path(path)
    if (base / TRACKER_FILENAME).is_file():
        return True
    return parse_iteration(base.name) is not None and is_complete_checkpoint(base)


@dataclass(frozen=True)
class PlannedLoad:
    """The checkpoint :func:`load_checkpoint` would load (see :func:`planned_load`).

    Attributes:
        path: The checkpoint directory (``iter_*``).
        iteration: Its iteration.
        weights_only: Loaded as a finetune start (``checkpoint.finetune`` or
            ``checkpoint.pretrained_checkpoint``): weights only, a new run at iteration 0.
        source: The setting it comes from (``"checkpoint.load"``, ``"non-persistent"``,
            ``"checkpoint.pretrained_checkpoint"``).
        fallbacks: Older complete checkpoints to load, newest first, if this one fails
            verification (only for "the newest checkpoint" of a save directory).
        explicit: Named by ``ckpt_step``, an ``iter_*`` path or ``pretrained_checkpoint``
            (never replaced by another checkpoint).
    """

    path: str
    iteration: int
    weights_only: bool
    source: str
    fallbacks: tuple[CheckpointLocation, ...] = ()
    explicit: bool = False


def _absent(path: str | os.PathLike[str], holds: str) -> str:
    """What is wrong with a directory a checkpoint was looked for in: ``holds`` or missing."""
    return holds if os.path.isdir(path) else "does not exist"


def planned_load(checkpoint_config: CheckpointConfig) -> PlannedLoad | None:
    """Which checkpoint :func:`load_checkpoint` would load, read from this process's files.

    No collective and no verification of the files: for reports and checks before a
    launch. ``checkpoint.load`` is used as it is (a launch first makes an unset ``load``
    the save directory when that holds a checkpoint).

    Raises:
        CheckpointError: What :func:`load_checkpoint` would raise choosing it (a missing
            ``ckpt_step`` or ``pretrained_checkpoint``, ...).
    """
    cfg = checkpoint_config
    load, step = cfg.load, cfg.ckpt_step
    persistent = find_latest_checkpoint(load, step) if load else None
    if load and persistent is None and step is not None:
        raise CheckpointError(
            f"checkpoint.ckpt_step={step}: checkpoint.load={str(load)!r} "
            f"{_absent(load, 'holds no checkpoints')}"
        )
    # Resuming "the newest checkpoint" of a save directory may fall back to an older one
    # that verifies; an explicitly named one (ckpt_step, an iter_* path) may not.
    explicit = step is not None or (
        persistent is not None and Path(persistent.path) == Path(str(load))
    )
    older = (
        () if persistent is None or explicit else older_complete(str(load), persistent.iteration)
    )
    if step is None and cfg.non_persistent_ckpt_type == "global":
        np_root = non_persistent_dir(cfg, base=str(load or ""))
        latest_np = find_latest_checkpoint(np_root) if np_root else None
        if latest_np is not None and (
            persistent is None or latest_np.iteration >= persistent.iteration
        ):
            chain = older_complete(str(np_root), latest_np.iteration) + older
            chain += () if persistent is None else (persistent,)
            return PlannedLoad(
                latest_np.path,
                latest_np.iteration,
                bool(cfg.finetune),
                "non-persistent",
                tuple(sorted(chain, key=lambda location: -location.iteration)),
            )
    if persistent is not None:
        return PlannedLoad(
            persistent.path,
            persistent.iteration,
            bool(cfg.finetune),
            "checkpoint.load",
            older,
            explicit,
        )
    if cfg.pretrained_checkpoint:
        pretrained = find_latest_checkpoint(cfg.pretrained_checkpoint)
        if pretrained is None:
            what = _absent(
                cfg.pretrained_checkpoint,
                "holds no checkpoint (no tracker and no complete iter_* directory)",
            )
            raise CheckpointError(
                f"checkpoint.pretrained_checkpoint={str(cfg.pretrained_checkpoint)!r} {what}; "
                "point it at a directory saved by bridge-train"
            )
        source = "checkpoint.pretrained_checkpoint"
        return PlannedLoad(pretrained.path, pretrained.iteration, True, source, explicit=True)
    if load and cfg.exit_on_missing_checkpoint:
        what = _absent(load, f"holds no checkpoint (no {TRACKER_FILENAME})")
        raise CheckpointError(
            f"checkpoint.load={str(load)!r} {what} and checkpoint.exit_on_missing_checkpoint="
            "True; fix the path, or unset exit_on_missing_checkpoint to start from a random "
            "initialisation"
        )
    return None


def _gather_damage(path: str, part: dict[str, str] | None) -> list[str]:
    """Every rank's ``checkpoint_problems`` of ``path`` (collective; empty if intact)."""
    if part is None:
        if global_rank() == 0:
            logger.warning(
                "%s was saved without content checksums (by an older bridge-train); loading it "
                "unverified",
                path,
            )
        return []
    return gather_problems(part)


def _verified_plan(plan: PlannedLoad, problems: list[str]) -> PlannedLoad:
    """The newest of ``plan``'s fallbacks whose files match their checksums (collective).

    ``problems``: what is wrong with ``plan``'s own checkpoint.

    Raises:
        CheckpointError: The checkpoint is damaged and no allowed fallback verifies. Nothing
            is deleted.
    """
    first_problem = problems[0] + (
        f" (and {len(problems) - 1} more files)" if len(problems) > 1 else ""
    )
    for skipped, candidate in enumerate(plan.fallbacks):
        if not _gather_damage(candidate.path, checkpoint_problems(candidate.path)):
            if global_rank() == 0:
                logger.error(  # a data-loss event: not hidden by filter_warnings
                    "checkpoint %s is damaged (%s%s); loading iteration %d (%s), the newest "
                    "older checkpoint whose files verify, instead (nothing was deleted)",
                    plan.path,
                    first_problem,
                    f"; {skipped} more" if skipped else "",
                    candidate.iteration,
                    candidate.path,
                )
            return PlannedLoad(candidate.path, candidate.iteration, plan.weights_only, plan.source)
    if plan.fallbacks:
        why = "and no older checkpoint's files verify either"
    elif plan.explicit:
        why = (
            "and it was named explicitly (checkpoint.ckpt_step, an iter_* path or "
            "checkpoint.pretrained_checkpoint), so no other checkpoint is loaded in its place"
        )
    else:
        why = "and there is no older complete checkpoint"
    raise CheckpointError(
        f"{first_problem}: the checkpoint {plan.path} is damaged and is not loaded, {why}; "
        "restore the directory from a copy, or point checkpoint.load / checkpoint.ckpt_step "
        "at another checkpoint (nothing was deleted)"
    )


def _layout_sizes(layout: dict[str, Any]) -> str:
    """``"TP2 PP1 CP1 DP1 EP1 ETP1"``: the sizes ``layout`` records (a MIMO model's own
    description added), or ``"no model parallelism"``."""
    sizes = [f"{short}{layout[name]}" for short, name, _ in LAYOUT_SIZES if name in layout]
    modules = layout.get("mimo_layout") or {}  # module -> "ranks 0-1 TP1 DP2"
    if modules:
        sizes.append(", ".join(f"{name} {placement}" for name, placement in modules.items()))
    return " ".join(sizes) or "no model parallelism"


def _rng_layout_changed(saved: dict[str, Any], layout: dict[str, Any]) -> bool:
    """Whether this rank's saved generator states were another layout's rank's.

    megatron seeds per pipeline rank (the default generator), tensor rank
    (``model-parallel-rng``) and expert-model and expert-tensor rank
    (``expert-parallel-rng``, see ``model_parallel_cuda_manual_seed``), so a change of any
    of those sizes, or of the world, CP or DP size, gives a global rank other coordinates
    and its saved states would be wrong for it. The virtual-pipeline size is not compared:
    no seed depends on the virtual stage, so under another VPP size every rank keeps its
    coordinates and its saved streams are its own. Checkpoints saved before the expert
    sizes were recorded are compared on the sizes they record.
    """
    expert = {"expert_model_parallel_size", "expert_tensor_parallel_size"}
    return any(
        saved.get(key) != layout.get(key)
        for key in saved.keys() | layout.keys()
        if key in saved or key not in expert
    )


def _check_reshardable(
    path: str,
    meta: dict[str, Any],
    layout: dict[str, Any],
    chunks: int,
    optimizer: MegatronOptimizer | None,
) -> bool:
    """Refuse, naming both layouts, a checkpoint this job's layout cannot be loaded from.

    Model tensors and optimizer state saved under layout-free keys reshard across every
    layout (another optimizer format or number of parts converts, see
    :mod:`~bridge.train.checkpointing.optimizer_conversion`). Refused: distributed-optimizer
    state of the older ``dp_reshardable`` format (kept per data-parallel bucket) under other
    TP, PP or VPP sizes, another optimizer kind or another number of parts.

    Returns:
        Whether the optimizer state must be converted (another format or number of parts).
    """
    saved_layout = meta.get("parallel_layout") or {}
    saved_chunks = meta.get("model_chunks", 1)
    saved_fmt = meta.get("optimizer_format")
    this_fmt = None if optimizer is None else optimizer_format(optimizer)

    def describe(layout: dict[str, Any], chunks: Any, optimizer: str | None) -> str:
        details = [f"world {layout.get('world_size')}", f"{chunks} model chunk(s)"]
        details += [f"{optimizer} optimizer"] if optimizer else []
        return f"{_layout_sizes(layout)} ({', '.join(details)})"

    def refuse(reason: str, fix: str) -> CheckpointError:
        return CheckpointError(
            f"{path} was saved as {describe(saved_layout, saved_chunks, saved_fmt)}, "
            f"this run is {describe(layout, chunks, this_fmt)}: {reason}; {fix}"
        )

    if optimizer is None or saved_fmt is None:
        return False
    saved_parts = meta.get("optimizer_parts")
    other_parts = saved_parts is not None and saved_parts != len(optimizer_parts(optimizer))
    if saved_fmt == "distributed:dp_reshardable":
        model_parallel = ("tensor_model_parallel_size", "pipeline_model_parallel_size")
        if not (this_fmt or "").startswith("distributed:") or other_parts:
            raise refuse(
                "its distributed-optimizer state (dp_reshardable, saved before fully "
                "reshardable checkpoints) is kept per data-parallel bucket and converts "
                "neither to per-parameter state nor to another number of optimizer parts",
                "set optimizer.use_distributed_optimizer and ddp.use_distributed_optimizer "
                "to true and keep model.expert_model_parallel_size above 1 (or at 1) as "
                "saved, or set checkpoint.load_optim=False to load the model (and train "
                "state) alone",
            )
        if saved_chunks != chunks or any(
            saved_layout.get(k) != layout.get(k) for k in model_parallel
        ):
            raise refuse(
                "its distributed-optimizer state (dp_reshardable, saved before fully "
                "reshardable checkpoints) reshards across data-parallel sizes only",
                "load it with the saved tensor, pipeline and virtual pipeline sizes, or set "
                "checkpoint.load_optim=False to load the model (and train state) alone",
            )
        return False
    return saved_fmt != this_fmt or other_parts


def _sharded_tensors(tree: Any) -> list[Any]:
    return [value for value in nested_values(tree) if isinstance(value, ShardedTensor)]


def _check_against_checkpoint(
    template: dict[str, Any], saved: dict[str, Any], path: str, model_keys: list[str], strict: bool
) -> None:
    """Compare the template's tensors with the checkpoint's before loading anything.

    ``saved``: the checkpoint's ``load_tensors_metadata``. Raises ``CheckpointError`` naming
    mismatched keys (global shapes differ) and, unless ``strict`` is False for model tensors,
    keys the checkpoint lacks. Missing model tensors are dropped from the template when not
    strict.
    """
    mismatched: dict[str, str] = {}
    model_tensors = [t for key in model_keys for t in _sharded_tensors(template[key])]
    optimizer_tensors = _sharded_tensors(
        [template.get("optimizer", {}), template.get(CONVERTED_OPTIMIZER_KEY, {})]
    )
    for tensor in model_tensors + optimizer_tensors:
        found = saved.get(tensor.key)
        if found is None or tensor.key in mismatched:
            continue
        saved_shape, shape = tuple(found.global_shape), tuple(tensor.global_shape)
        # Embedding and output tables may differ in their padded vocabulary (axis 0) only.
        first = 1 if tensor.allow_shape_mismatch else 0
        if saved_shape[first:] != shape[first:]:
            mismatched[tensor.key] = f"{tensor.key} (checkpoint {saved_shape}, model {shape})"
    if mismatched:
        listed = list(mismatched.values())
        raise CheckpointError(
            f"{path} was saved from a model of a different shape: "
            + "; ".join(listed[:5])
            + (f"; and {len(listed) - 5} more" if len(listed) > 5 else "")
            + ". Load it into a model built with the same configuration (run_config.yaml in "
            "the checkpoint directory holds it)"
        )
    missing_model = []
    for key in model_keys:
        chunk = template[key]
        for name, value in list(chunk.items()):
            if isinstance(value, ShardedTensor) and value.key not in saved:
                missing_model.append(value.key)
                if not strict:
                    del chunk[name]
    if missing_model and strict:
        raise CheckpointError(
            f"{path} lacks model tensors {sorted(missing_model)[:5]}"
            + (f" and {len(missing_model) - 5} more" if len(missing_model) > 5 else "")
            + "; it was saved from a different model (or load with strict=False to keep "
            "their initial values)"
        )
    if missing_model:
        logger.warning(
            "%s lacks model tensors %s; they keep their initial values (strict=False)",
            path,
            sorted(missing_model),
        )
    missing_optimizer = [t.key for t in optimizer_tensors if t.key not in saved]
    if missing_optimizer:
        raise CheckpointError(
            f"{path} lacks optimizer state {sorted(missing_optimizer)[:5]}; it was saved with "
            "another optimizer or model: set checkpoint.load_optim=False to start the "
            "optimizer afresh"
        )


def _dist_load(template: dict[str, Any], path: str, cfg: CheckpointConfig) -> dict[str, Any]:
    strategy: Any = TorchDistLoadShardedStrategy()
    if cfg.fully_parallel_load and parallel_state.model_parallel_is_initialized():
        strategy = FullyParallelLoadStrategyWrapper(
            strategy, parallel_state.get_data_parallel_group(with_context_parallel=True)
        )
    try:
        loaded = dist_checkpointing.load(template, path, strategy, strict=cfg.dist_ckpt_strictness)
    except (CheckpointException, CheckpointingException) as exc:
        raise CheckpointError(f"loading {path} failed: {exc}") from None
    if isinstance(loaded, tuple):  # strictness "return_*": (state, missing, unexpected)
        loaded, missing, unexpected = loaded
        if missing or unexpected:
            logger.warning("%s: missing keys %s, unexpected keys %s", path, missing, unexpected)
    return loaded


def _load_main_params(
    optimizer: MegatronOptimizer, model: list[torch.nn.Module], path: str, cfg: CheckpointConfig
) -> None:
    """Restore the optimizer's fp32 main parameters from the checkpoint's copies."""
    sharded = optimizer_sharded_state_dict(optimizer, model_sharded_state_dict(model))
    groups = sharded.get("fp32_from_fp16_params") if isinstance(sharded, dict) else None
    if not groups:
        raise CheckpointError(
            "checkpoint.load_main_params_from_ckpt=True, but the optimizer keeps no separate "
            "fp32 main parameters (the model is not bf16/fp16); unset load_main_params_from_ckpt"
        )
    template = {"bridge_main_params": groups}
    saved = load_tensors_metadata(path)
    absent = [t.key for t in _sharded_tensors(template) if t.key not in saved]
    if absent:
        raise CheckpointError(
            f"checkpoint.load_main_params_from_ckpt=True, but {path} holds no fp32 main "
            f"parameters (e.g. {absent[0]}); it was saved without optimizer state or from an "
            "fp32 model: unset load_main_params_from_ckpt"
        )
    live = [t.data for t in _sharded_tensors(template)]
    loaded = _dist_load(template, path, cfg)
    with torch.no_grad():
        for target, value in zip(live, nested_values(loaded["bridge_main_params"]), strict=True):
            target.copy_(value)


def _read_checkpoint(
    path: str,
    cfg: CheckpointConfig,
    model: list[torch.nn.Module],
    optimizer: MegatronOptimizer | None,
    load_rng: bool,
    strict: bool,
    model_config: ModelConfigProtocol | None,
) -> tuple[dict[str, Any], dict[str, Any], OptimizerConversion | None, bool]:
    """Read the checkpoint at ``path`` after checking it fits; nothing is applied yet.

    ``optimizer``: only when its state is to be loaded; ``model_config``: only when the
    architecture is to be checked (resuming, not ``finetune``).

    Returns:
        ``(common, loaded, conversion, layout_changed)``: ``conversion`` is set when the
        optimizer state is of another format or number of parts; ``layout_changed`` when
        ``load_rng`` asked for RNG state the layout change makes another rank's (not read).
    """
    # A single-process read on each rank: its warnings are held by restore_checkpoint.
    try:
        common = load_common_state_dict(path)
    except (CheckpointException, CheckpointingException, OSError) as exc:
        raise CheckpointError(f"cannot read the checkpoint {path}: {exc}") from None
    meta = common.get(META_KEY)
    if not isinstance(meta, dict):
        raise CheckpointError(
            f"{path} is a dist_checkpointing checkpoint but not one saved by bridge-train "
            f"(no {META_KEY!r} entry)"
        )
    if int(meta.get("version", -1)) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} was saved in checkpoint format {meta.get('version')}, newer than this "
            f"bridge-train reads ({FORMAT_VERSION}); upgrade bridge-train"
        )
    if optimizer is not None and not meta.get("optimizer"):
        raise CheckpointError(
            f"{path} was saved without optimizer state (checkpoint.save_optim=False); "
            "set checkpoint.load_optim=False (or finetune=True) to load the model alone"
        )
    if load_rng and not meta.get("rng"):
        raise CheckpointError(
            f"{path} was saved without RNG state (checkpoint.save_rng=False); set "
            "checkpoint.load_rng=False to keep this run's seeds"
        )
    layout = parallel_layout(model)
    convert = _check_reshardable(path, meta, layout, len(model), optimizer)
    # The generators are per rank: another layout has no counterpart to restore them into;
    # restore_checkpoint names both layouts and reseeds (its ``reseed``).
    layout_changed = load_rng and _rng_layout_changed(meta.get("parallel_layout") or {}, layout)
    template = sharded_entries(model, optimizer, rng=load_rng and not layout_changed, saved=meta)
    conversion = None
    saved = load_tensors_metadata(path)
    if convert:
        # Another optimizer format or number of parts: this run's own template, its
        # tensors loaded by key under an entry of their own (the checkpoint's common
        # optimizer state has the other layout, which dist_checkpointing would merge in).
        conversion = conversion_template(template.pop("optimizer"), saved)
        template[CONVERTED_OPTIMIZER_KEY] = conversion.to_load
    _check_against_checkpoint(template, saved, path, model_state_keys(len(model)), strict)
    check_same_architecture(model_config, path)  # shapes fit: the architecture must too
    return common, _dist_load(template, path, cfg), conversion, layout_changed


def load_checkpoint(
    state: GlobalState,
    model: list[torch.nn.Module],
    optimizer: MegatronOptimizer | None,
    opt_param_scheduler: OptimizerParamScheduler | None,
    strict: bool = True,
    checkpointing_context: dict[str, Any] | None = None,
    skip_load_to_model_and_opt: bool = False,
    reseed: Callable[[int], int] | None = None,
) -> tuple[int, float]:
    """Load the configured checkpoint into the model, optimizer, scheduler and state.

    Megatron-Bridge's form of :func:`restore_checkpoint`: the ``checkpoint`` section and the
    model config (architecture check) come from ``state.cfg``, the counters restored in
    place are ``state.train_state``.

    Args:
        state: The run's ``GlobalState``; the other arguments, the return value and the
            errors are :func:`restore_checkpoint`'s.
    """
    return restore_checkpoint(
        required_checkpoint_section(state.cfg.checkpoint),
        state.train_state,
        model,
        optimizer,
        opt_param_scheduler,
        model_config=getattr(getattr(state, "cfg", None), "model", None),
        strict=strict,
        checkpointing_context=checkpointing_context,
        skip_load_to_model_and_opt=skip_load_to_model_and_opt,
        reseed=reseed,
    )


def restore_checkpoint(
    checkpoint_config: CheckpointConfig,
    train_state: TrainState,
    model: list[torch.nn.Module],
    optimizer: MegatronOptimizer | None,
    opt_param_scheduler: OptimizerParamScheduler | None,
    *,
    model_config: ModelConfigProtocol | None = None,
    strict: bool = True,
    checkpointing_context: dict[str, Any] | None = None,
    skip_load_to_model_and_opt: bool = False,
    reseed: Callable[[int], int] | None = None,
) -> tuple[int, float]:
    """Load the checkpoint ``checkpoint_config`` names into the model, optimizer, scheduler
    and counters.

    Collective: every rank calls it. See the module docstring for which checkpoint is
    chosen and what is restored. Tensor-parallel layouts may differ from the saved one
    (dist_checkpointing reshards); RNG state is restored only for the same layout.

    Args:
        checkpoint_config: The ``checkpoint`` section (which checkpoint, what to load).
        train_state: The run's counters, restored in place.
        model: Model chunks, built like the saved ones.
        optimizer: The optimizer, or None.
        opt_param_scheduler: The scheduler (megatron ``OptimizerParamScheduler``), or None.
            It is restored exactly, also if it was stepped before.
        model_config: The run's model config: resuming (not ``finetune``) a checkpoint of
            another architecture is refused (``None``: not checked).
        strict: Model tensors missing from the checkpoint are an error (else they keep
            their values).
        checkpointing_context: From :func:`init_checkpointing_context`; when given, its
            ``"loaded_checkpoint"`` entry is set to the directory loaded (``None`` when
            nothing was loaded).
        skip_load_to_model_and_opt: Read the checkpoint and restore scheduler, RNG and
            train state, but do not copy into the model and optimizer.
        reseed: Called with the resumed iteration when ``load_rng`` asked for RNG state
            that cannot be restored because the parallel layout differs (the saved
            generator states are per rank): it reseeds this process's generators from
            ``rng.seed`` and that iteration (see
            :func:`~bridge.train.engine.initialize.resume_seed`; ``pretrain`` through
            :func:`~bridge.train.engine.initialize.seed_from_rng_config`, the ``mimo``
            recipe through :func:`~bridge.train.engine.initialize.seed_process_generators`)
            and returns the ``rng.seed`` it used, which the one warning naming both layouts
            states. ``None``: the generators keep this run's initial seeds.

    Returns:
        ``(iteration, num_floating_point_operations_so_far)`` of the loaded checkpoint;
        ``(0, 0.0)`` when nothing was loaded or for ``finetune`` / a pretrained checkpoint.

    Raises:
        CheckpointError: ``exit_on_missing_checkpoint`` with nothing to load; a missing
            ``pretrained_checkpoint`` or ``ckpt_step``; a damaged checkpoint (its files do
            not match their checksums) with no allowed fallback; a checkpoint of another
            model shape (the message names the key) or, when resuming (not ``finetune``),
            of another architecture than ``model_config`` (see
            :mod:`~bridge.train.checkpointing.architecture`); state requested that was not
            saved.
        ConfigError: An unsupported checkpoint setting.
    """
    cfg = checkpoint_config
    check_checkpoint_config(cfg)
    model = list(model) if isinstance(model, (list, tuple)) else [model]
    context = checkpointing_context if checkpointing_context is not None else {}
    context["loaded_checkpoint"] = None
    plan: PlannedLoad | None = run_on_rank0(planned_load, cfg)
    if plan is None:
        if cfg.load and global_rank() == 0:
            logger.warning(
                "no checkpoint found in checkpoint.load=%s; starting from a random initialisation",
                cfg.load,
            )
        return 0, 0.0
    started = time.monotonic()
    finetune = plan.weights_only
    load_optim = bool(cfg.load_optim) and not finetune and optimizer is not None
    read = functools.partial(
        _read_checkpoint,
        cfg=cfg,
        model=model,
        optimizer=optimizer if load_optim else None,
        load_rng=bool(cfg.load_rng) and not finetune,
        strict=strict,
        model_config=None if finetune else model_config,
    )
    # torch.distributed.checkpoint warns on every load (argument order, ShardedTensor's
    # deprecation, "assuming the intent is to load in a single process" for the common
    # state rank 0 reads alone): nothing to act on, so held back (DEBUG on rank 0).
    with held_notices() as held:
        # The checksums are verified in a thread while the checkpoint is read (file reads
        # and XXH3 release the GIL), and the verdict is taken before anything is copied
        # into the model or optimizer: a damaged checkpoint is never used, and its cost
        # mostly hides.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-verify") as pool:
            local = pool.submit(checkpoint_problems, plan.path)
            try:
                result: Any = read(plan.path)
            except Exception as exc:  # damage can surface as any error of the readers
                result = exc
            problems = _gather_damage(plan.path, local.result())
        if problems:
            plan = _verified_plan(plan, problems)
            result = read(plan.path)
        elif isinstance(result, Exception):
            raise result
    if global_rank() == 0:
        log_held_notices(held, logger)
    common, loaded, conversion, layout_changed = result
    context["loaded_checkpoint"] = plan.path
    saved_schedule = (
        common.get("opt_param_scheduler")
        if load_optim and opt_param_scheduler is not None
        else None
    )
    if saved_schedule is not None:  # refused before anything is applied
        check_scheduler_settings(opt_param_scheduler, saved_schedule, plan.path)

    if not skip_load_to_model_and_opt:
        for key, chunk in zip(model_state_keys(len(model)), unwrapped_chunks(model), strict=True):
            chunk.load_state_dict(loaded[key], strict=strict)
        if load_optim:
            state = loaded["optimizer" if conversion is None else CONVERTED_OPTIMIZER_KEY]
            load_optimizer(optimizer, state, common, conversion, opt_param_scheduler, plan.path)
        elif optimizer is not None:
            if cfg.load_main_params_from_ckpt and not finetune:
                _load_main_params(optimizer, model, plan.path, cfg)
            else:
                optimizer.reload_model_params()
    if saved_schedule is not None and opt_param_scheduler is not None:
        # Exactly: megatron's load_state_dict advances by the saved step count from the
        # current one.
        opt_param_scheduler.num_steps = 0
        opt_param_scheduler.load_state_dict(saved_schedule)
    if RNG_STATE_KEY in loaded:
        restore_rng_state(loaded[RNG_STATE_KEY])
    elif layout_changed:
        iteration = int(common["iteration"])
        seed = None if reseed is None else reseed(iteration)
        if global_rank() == 0:
            logger.warning(
                "resuming iteration %d of %s under another parallel layout (%s -> %s): its "
                "RNG states are per rank and not restored; %s",
                iteration,
                plan.path,
                _layout_sizes(common[META_KEY].get("parallel_layout") or {}),
                _layout_sizes(parallel_layout(model)),
                "the generators keep this run's initial seeds"
                if seed is None
                else f"the generators are reseeded from rng.seed={seed} and iteration "
                f"{iteration} (base seed {resume_seed(int(seed), iteration)}; dropout masks "
                "depend on the layout)",
            )

    if finetune:
        iteration, flops = 0, 0.0
        train_state.step = 0
        train_state.consumed_train_samples = 0
        train_state.skipped_train_samples = 0
        train_state.consumed_valid_samples = 0
        train_state.floating_point_operations_so_far = 0.0
    else:
        train_state.load_state_dict(common["train_state"])
        iteration = int(common["iteration"])
        flops = float(common["num_floating_point_operations_so_far"])
    if dist_ready():
        torch.distributed.barrier()
    if global_rank() == 0:
        logger.info(
            "loaded %s checkpoint of iteration %d from %s (%s; %.2f s)",
            plan.source,
            plan.iteration,
            plan.path,
            "model only"
            if finetune
            else ("with optimizer" if load_optim else "model, no optimizer"),
            time.monotonic() - started,
        )
    return iteration, flops
