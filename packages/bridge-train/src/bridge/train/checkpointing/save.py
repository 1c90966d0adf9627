"""Saving a checkpoint: write every shard, then commit (marker, rename, tracker) on rank 0.

A save of iteration ``N`` into ``root``:

1. rank 0 creates ``root/iter_000000N.tmp`` (removing leftovers of crashed saves);
2. every rank writes its shards there with megatron-core dist_checkpointing (inside the
   CPU compatibility layer), synchronously or in a background process;
3. once all ranks have finished (for async saves: when ``finalize_async_saves`` sees it),
   rank 0 writes ``run_config.yaml``, flushes the directory, writes the completion marker,
   renames it to ``root/iter_000000N`` and only then rewrites the tracker
   ``latest_checkpointed_iteration.txt`` (temp file, fsync, rename, fsync of the directory).
   For non-persistent checkpoints, older ones are removed after that.

A crash before step 3 completes leaves the previous checkpoint as the newest: loading
follows the tracker and never counts a directory without its marker.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import functools
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint.api import CheckpointException

from bridge.config import CheckpointConfig, ConfigError
from bridge.config.atomic_files import fsync_directory
from bridge.train.checkpointing.async_save import (
    ensure_write_results_queue,
    finalize_async_saves,
    get_async_calls_queue,
)
from bridge.train.checkpointing.context import (
    check_checkpoint_config,
    init_checkpointing_context,
    non_persistent_dir,
    required_checkpoint_section,
)
from bridge.train.checkpointing.errors import CheckpointError, run_on_rank0
from bridge.train.checkpointing.integrity import (
    CHECKSUM_ALGORITHM,
    checkpoint_problems,
    checksum_file,
    checksum_files,
)
from bridge.train.checkpointing.layout import (
    DAMAGED_SUFFIX,
    MARKER_FILENAME,
    RETIRED_SUFFIX,
    RUN_CONFIG_FILENAME,
    STAGING_SUFFIX,
    checkpoint_dir_name,
    is_complete_checkpoint,
    parse_iteration,
    read_tracker,
    retired_path,
    staging_path,
    write_marker,
    write_tracker,
)
from bridge.train.checkpointing.state_dict import (
    FORMAT_VERSION,
    build_save_state_dict,
)
from core_utils import cpu_cuda_compat
from core_utils.distributed import any_rank, global_rank

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from bridge.resiliency import FaultTolerance
    from bridge.train.state import GlobalState, TrainState

__all__ = ["SUPPLIED_SAVE_STRATEGY", "RunConfigFile", "save_checkpoint", "write_checkpoint"]

# Checkpointing-context key of a dist_checkpointing save strategy that replaces the default
# one (synchronous saves only); everything else about the save (staging, checksums, marker,
# commit) is unchanged.
SUPPLIED_SAVE_STRATEGY = "supplied_save_strategy"

logger = logging.getLogger(__name__)

# Staging directories of this process's saves not yet committed (tracked on every rank); a
# forked child (a rank started from a parent that saved) has none of its own yet.
_PENDING: set[str] = set()
os.register_at_fork(after_in_child=_PENDING.clear)


def _fsync_tree(path: str | os.PathLike[str]) -> None:
    """Flush every file and directory under ``path`` (cheap for files already synced)."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_directory(root)


def _remove_tree(path: str | os.PathLike[str]) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)


@dataclass(frozen=True)
class _Commit:
    root: str
    staging: str
    iteration: int
    non_persistent: bool
    marker: dict[str, Any]
    config: RunConfigFile | None
    started: float


def _save_root(checkpoint_config: CheckpointConfig, non_persistent: bool) -> str:
    if non_persistent:
        if checkpoint_config.non_persistent_ckpt_type != "global":
            raise ConfigError(
                "checkpoint.non_persistent_ckpt_type",
                f"is {checkpoint_config.non_persistent_ckpt_type!r} but a non-persistent "
                "checkpoint was requested; set it to 'global'",
            )
        directory = non_persistent_dir(checkpoint_config)
        # CheckpointConfig refuses type 'global' with neither this directory nor save.
        assert directory is not None
        return directory
    if not checkpoint_config.save:
        raise ConfigError(
            "checkpoint.save", "is not set; set it to the directory checkpoints are saved to"
        )
    return str(checkpoint_config.save)


def _os_reason(exc: OSError) -> str:
    """``No space left on device (/runs/a/iter_0000020.tmp/__0_0.distcp)``: the reason and path."""
    reason = exc.strerror or str(exc)
    path = exc.filename
    return f"{reason} ({path})" if path else reason


def describe_save_failure(exc: BaseException, root: str | None = None) -> str:
    """One line for a failed write: the first OS error inside ``exc`` (any rank), else its text.

    torch.distributed.checkpoint wraps per-rank failures (``CheckpointException.failures``)
    with their tracebacks; the user needs the reason and the path.
    """
    seen: set[int] = set()
    todo: list[Any] = [exc]
    leaf = ""
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError):
            return _os_reason(current)
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            todo.extend(item[0] if isinstance(item, tuple) else item for item in failures.values())
        elif not leaf and str(current).strip():
            # A worker's error crosses a process boundary as text ("Worker failure: [Errno
            # 28] No space left on device: '<path>'"): its first line is the reason.
            leaf = str(current).strip().splitlines()[0]
        todo.extend([current.__cause__, current.__context__])
    if root is not None and "Errno" not in leaf:
        # megatron's writer threads report some OS errors by class only; a full disk is the
        # common one and the file system says so itself.
        with contextlib.suppress(OSError):
            usage = shutil.disk_usage(root)
            if usage.free < min(1 << 20, usage.total // 100 + 1) or usage.free < 1 << 16:
                return f"No space left on device ({root}: {usage.free} bytes free)"
    return leaf or type(exc).__name__


def _prepare_staging(root: str, iteration: int) -> str:
    """A new staging directory of ``iteration`` in ``root``, made after removing the
    leftovers of crashed saves there (never a complete, committed checkpoint).

    Staging directories not being written by this process are incomplete by construction
    and are deleted. A retired directory (``iter_N.old``) exists only between the two
    renames that replace a checkpoint by a new save of the same iteration: if the new one
    did not arrive, the old one is moved back, else it is deleted.
    """
    base = Path(root)
    try:
        base.mkdir(parents=True, exist_ok=True)
        for entry in list(base.iterdir()):
            name = entry.name
            if not entry.is_dir() or not name.startswith("iter_"):
                continue
            if name.endswith(STAGING_SUFFIX) and str(entry) not in _PENDING:
                _remove_tree(entry)
            elif name.endswith(RETIRED_SUFFIX):
                old = parse_iteration(name.removesuffix(RETIRED_SUFFIX))
                if old is None:
                    continue
                final = base / checkpoint_dir_name(old)
                if not final.exists() and is_complete_checkpoint(entry):
                    os.rename(entry, final)
                    fsync_directory(base)
                else:
                    _remove_tree(entry)
        staging = staging_path(base, iteration)
        _remove_tree(staging)  # an earlier save of this iteration that never completed
        staging.mkdir()
    except OSError as exc:
        raise CheckpointError(
            f"cannot create the checkpoint directory of iteration {iteration} under {root}: "
            f"{_os_reason(exc)}; {intact_note(root)}"
        ) from None
    return str(staging)


# Fields megatron's training code fills with live callables at run time (not configuration).
_RUNTIME_HOOK_FIELDS = (
    "no_sync_func",
    "grad_sync_func",
    "param_sync_func",
    "finalize_model_grads_func",
    "grad_scale_func",
    "timers",
)


def _write_run_config(config: RunConfigFile | None, directory: Path) -> None:
    """Save the run's config beside the checkpoint (runtime hooks left out)."""
    if config is None or not hasattr(config, "to_yaml"):
        return
    model = getattr(config, "model", None)
    hooks = [name for name in _RUNTIME_HOOK_FIELDS if getattr(model, name, None) is not None]
    if hooks:  # written from shallow copies: the live run keeps its hooks
        model = copy.copy(model)
        for name in hooks:
            object.__setattr__(model, name, None)
        config = copy.copy(config)
        object.__setattr__(config, "model", model)
    try:
        config.to_yaml(directory / RUN_CONFIG_FILENAME)
    except ConfigError as exc:  # a value YAML cannot hold; the weights matter more
        logger.warning(
            "checkpoint %s: run_config.yaml not written (%s); the checkpoint itself is complete",
            directory.name,
            exc,
        )


def intact_note(root: str | os.PathLike[str]) -> str:
    """What a failed save left: which checkpoint of ``root`` is still the newest complete one."""
    tracked = None
    with contextlib.suppress(CheckpointError):  # an unreadable tracker names none
        tracked = read_tracker(root)
    if tracked is not None:
        path = Path(root) / checkpoint_dir_name(tracked)
        if is_complete_checkpoint(path):
            return f"the last complete checkpoint, iteration {tracked} ({path}), is intact"
    return f"{root} holds no earlier complete checkpoint"


def _commit_on_rank0(commit: _Commit, files: dict[str, Any]) -> None:
    root = Path(commit.root)
    staging = Path(commit.staging)
    final = root / checkpoint_dir_name(commit.iteration)
    retired = retired_path(root, commit.iteration)
    try:
        _write_run_config(commit.config, staging)
        if (staging / RUN_CONFIG_FILENAME).is_file():
            files = {**files, RUN_CONFIG_FILENAME: checksum_file(staging / RUN_CONFIG_FILENAME)}
        _fsync_tree(staging)
        write_marker(staging, {**commit.marker, "checksum": CHECKSUM_ALGORITHM, "files": files})
        if final.exists() and checkpoint_problems(final, share=False):
            # Nothing damaged is deleted: it stays for the user to inspect or restore.
            aside, number = final.with_name(final.name + DAMAGED_SUFFIX), 1
            while aside.exists():
                number += 1
                aside = final.with_name(f"{final.name}{DAMAGED_SUFFIX}{number}")
            os.rename(final, aside)
            logger.error(  # a data-loss event: not hidden by filter_warnings
                "%s is damaged; it was moved to %s (not deleted) and iteration %d is saved anew",
                final,
                aside,
                commit.iteration,
            )
        if final.exists():
            # A checkpoint of the same iteration exists: keep it until the new one is in place.
            _remove_tree(retired)
            os.rename(final, retired)
        os.rename(staging, final)
        fsync_directory(root)
        write_tracker(root, commit.iteration)
        _remove_tree(retired)
    except OSError as exc:
        raise CheckpointError(
            f"cannot commit the checkpoint of iteration {commit.iteration} in {root}: "
            f"{_os_reason(exc)}; {intact_note(root)}"
        ) from None
    if commit.non_persistent:
        for entry in list(root.iterdir()):  # _remove_tree leaves files alone
            if parse_iteration(entry.name) not in (None, commit.iteration):
                _remove_tree(entry)


def _commit(commit: _Commit) -> None:
    """Make a written checkpoint count (every rank calls it; rank 0 does the work)."""
    try:
        files = checksum_files(commit.staging, exclude=(RUN_CONFIG_FILENAME, MARKER_FILENAME))
        unreadable = [entry["error"] for entry in files.values() if "error" in entry]
        if unreadable:
            raise CheckpointError(
                f"cannot read back the checkpoint of iteration {commit.iteration}: "
                f"{unreadable[0]}; {intact_note(commit.root)}"
            )
        run_on_rank0(_commit_on_rank0, commit, files)
    finally:
        _PENDING.discard(commit.staging)
    if global_rank() == 0:
        kind = "non-persistent checkpoint" if commit.non_persistent else "checkpoint"
        logger.info(
            "saved %s of iteration %d to %s (%.2f s)",
            kind,
            commit.iteration,
            os.path.join(commit.root, checkpoint_dir_name(commit.iteration)),
            time.monotonic() - commit.started,
        )


def _structure_changed(sharded: dict[str, Any], context: dict[str, Any]) -> bool:
    """Whether the sharded structure differs from the previous save of this context (any rank).

    The structure is every sharded tensor's key, dtype, shapes, offsets and replica id and
    every sharded object's key; values do not matter. Collective over the world, so every
    rank takes the same decision.
    """
    items: list[Any] = []
    for value in nested_values(sharded):
        if isinstance(value, ShardedTensor):
            items.append(
                (
                    value.key,
                    str(value.dtype),
                    tuple(value.global_shape),
                    tuple(value.local_shape),
                    tuple(value.global_offset),
                    tuple(value.axis_fragmentations or ()),
                    value.replica_id,
                    value.flattened_range,
                )
            )
        elif isinstance(value, ShardedObject):
            items.append((value.unique_key, value.replica_id))
        elif isinstance(value, ShardedTensorFactory):
            items.append((value.key, str(value.data.dtype), tuple(value.data.shape)))
    fingerprint = hash(tuple(repr(item) for item in items))
    changed = fingerprint != context.get("structure")
    context["structure"] = fingerprint
    return any_rank(changed)


def _save_strategy(
    checkpoint_config: CheckpointConfig, context: dict[str, Any], changed: bool
) -> Any:
    """dist_checkpointing's save strategy (kept between saves while the structure holds).

    With ``ckpt_assume_constant_structure`` the strategy caches its save plans and global
    metadata between saves; a structure change (which the setting promises not to happen)
    starts a fresh strategy instead of reusing stale plans.
    """
    supplied = context.get(SUPPLIED_SAVE_STRATEGY)
    if supplied is not None:  # a caller with its own way of writing (the streaming HF import)
        return supplied
    constant = bool(checkpoint_config.ckpt_assume_constant_structure)
    cached = context.get("save_strategy")
    if cached is not None and constant and not changed:
        return cached
    strategy: Any = TorchDistSaveShardedStrategy(cached_metadata=constant)
    if checkpoint_config.fully_parallel_save and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        if torch.distributed.get_world_size(group) > 1:
            strategy = FullyParallelSaveStrategyWrapper(
                strategy, group, do_cache_distribution=constant
            )
    context["save_strategy"] = strategy if constant else None
    return strategy


class RunConfigFile(Protocol):
    """What a checkpoint needs of the run's configuration: it is saved beside the weights as
    ``run_config.yaml`` (a ``ConfigContainer``; any object with a ``model`` attribute and a
    ``to_yaml(path)`` method)."""

    @property
    def model(self) -> Any:
        """The model config (live hooks megatron fills in are left out of the file)."""
        ...

    def to_yaml(self, path: str | os.PathLike[str]) -> None:
        """Write the configuration as YAML to a new file ``path``."""
        ...


def save_checkpoint(
    state: GlobalState,
    model: list[torch.nn.Module],
    optimizer: MegatronOptimizer | None,
    opt_param_scheduler: OptimizerParamScheduler | None,
    num_floating_point_operations_so_far: float,
    checkpointing_context: dict[str, Any] | None = None,
    non_persistent_ckpt: bool = False,
    train_data_iterator: Any = None,
) -> None:
    """Save a checkpoint of iteration ``state.train_state.step`` (Megatron-Bridge's form).

    :func:`write_checkpoint` with the pieces taken from ``state``: its ``cfg.checkpoint``
    section, ``train_state``, ``cfg`` (saved as ``run_config.yaml``) and
    ``fault_tolerance``.

    Args:
        state: The run's ``GlobalState``; ``num_floating_point_operations_so_far`` and
            ``non_persistent_ckpt`` are :func:`write_checkpoint`'s ``flops_so_far`` and
            ``non_persistent``; the other arguments and the errors are its own.
        train_data_iterator: Accepted for megatron compatibility; the data samplers resume
            from ``train_state.consumed_train_samples``, so nothing else is stored.
    """
    del train_data_iterator
    write_checkpoint(
        required_checkpoint_section(state.cfg.checkpoint),
        state.train_state,
        model,
        optimizer,
        opt_param_scheduler,
        run_config=getattr(state, "cfg", None),
        flops_so_far=num_floating_point_operations_so_far,
        checkpointing_context=checkpointing_context,
        non_persistent=non_persistent_ckpt,
        fault_tolerance=getattr(state, "fault_tolerance", None),
    )


def write_checkpoint(
    checkpoint_config: CheckpointConfig,
    train_state: TrainState,
    model: list[torch.nn.Module],
    optimizer: MegatronOptimizer | None,
    scheduler: OptimizerParamScheduler | None,
    *,
    run_config: RunConfigFile | None = None,
    flops_so_far: float | None = None,
    checkpointing_context: dict[str, Any] | None = None,
    non_persistent: bool = False,
    fault_tolerance: FaultTolerance | None = None,
) -> None:
    """Save a checkpoint of iteration ``train_state.step`` as ``checkpoint_config`` says.

    Collective: every rank calls it. Writes model (sharded like its parameters), optimizer
    state (``checkpoint.save_optim``; sharded like each parameter), scheduler, per-rank RNG
    state (``checkpoint.save_rng``), the train state and ``run_config``. With
    ``checkpoint.async_save`` the shards are written in the background and the checkpoint
    counts once :func:`finalize_async_saves` has finalized it; otherwise it counts when this
    returns. The tracker is updated last, atomically, so a crash keeps the previous
    checkpoint as the newest; a complete checkpoint is never deleted before its replacement
    is complete. The trainer's save and tools (the Hugging Face importer) call this.

    Args:
        checkpoint_config: The ``checkpoint`` section (where and what to save).
        train_state: The run's counters (saved; ``step`` names the checkpoint).
        model: Model chunks.
        optimizer: The optimizer (``sharded_state_dict``), or None.
        scheduler: The scheduler (``state_dict``), or None.
        run_config: Saved as ``run_config.yaml`` beside the weights (``None``: none).
        flops_so_far: FLOPs so far, stored with the train state (default: its
            ``floating_point_operations_so_far``).
        checkpointing_context: From :func:`init_checkpointing_context` (made when None).
        non_persistent: Save a global non-persistent checkpoint (into
            ``non_persistent_global_ckpt_dir`` or ``<save>/non_persistent``; only the newest
            is kept).
        fault_tolerance: The run's fault-tolerance hooks: committing an earlier
            asynchronous save is a checkpointing section.

    Raises:
        ConfigError: No directory to save to, or an unsupported setting.
        CheckpointError: The directory cannot be written, or dist_checkpointing failed.
    """
    check_checkpoint_config(checkpoint_config)
    if checkpointing_context is None:
        checkpointing_context = init_checkpointing_context(checkpoint_config)
    root = _save_root(checkpoint_config, non_persistent)
    model = list(model) if isinstance(model, (list, tuple)) else [model]
    iteration = int(train_state.step)
    flops = train_state.floating_point_operations_so_far if flops_so_far is None else flops_so_far
    started = time.monotonic()
    ensure_write_results_queue()
    if checkpoint_config.async_save:
        # Commit earlier saves that have finished (collective, like the save itself); a save
        # of this very iteration still in flight is waited for.
        in_flight = str(staging_path(root, iteration)) in _PENDING
        finalize_async_saves(fault_tolerance, blocking=in_flight)

    staging = run_on_rank0(_prepare_staging, root, iteration)
    _PENDING.add(staging)
    sharded = build_save_state_dict(
        model,
        optimizer,
        scheduler,
        train_state,
        flops,
        save_optim=bool(checkpoint_config.save_optim),
        save_rng=bool(checkpoint_config.save_rng),
    )
    meta = sharded["bridge_checkpoint"]
    marker = {
        "iteration": iteration,
        "format": checkpoint_config.ckpt_format,
        "bridge_checkpoint_version": FORMAT_VERSION,
        "non_persistent": bool(non_persistent),
        "async_save": bool(checkpoint_config.async_save),
        **{key: meta[key] for key in ("parallel_layout", "optimizer", "rng")},
        "saved_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    commit = _Commit(
        root=root,
        staging=staging,
        iteration=iteration,
        non_persistent=bool(non_persistent),
        marker=marker,
        config=run_config,
        started=started,
    )
    # Sharding integrity is checked (a collective) whenever the structure is new; a save of
    # an unchanged structure skips it, as megatron does with a constant structure.
    changed = _structure_changed(sharded, checkpointing_context)
    strategy = _save_strategy(checkpoint_config, checkpointing_context, changed)

    try:
        with cpu_cuda_compat():
            # The same planned save either way; async returns the request that writes it.
            request = dist_checkpointing.save(
                sharded,
                staging,
                strategy,
                validate_access_integrity=changed,
                async_sharded_save=bool(checkpoint_config.async_save),
                async_strategy="mcore",
            )
            if request is not None:
                request.add_finalize_fn(functools.partial(_commit, commit))
                queue = get_async_calls_queue(bool(checkpoint_config.use_persistent_ckpt_worker))
                queue.schedule_async_request(request)
    except (CheckpointException, CheckpointingException, OSError) as exc:
        _PENDING.discard(staging)
        raise CheckpointError(
            f"saving the checkpoint of iteration {iteration} to {root} failed: "
            f"{describe_save_failure(exc, root)}; {intact_note(root)}"
        ) from None
    if request is None:
        _commit(commit)
    elif global_rank() == 0:
        logger.info("scheduled asynchronous save of iteration %d to %s", iteration, root)
