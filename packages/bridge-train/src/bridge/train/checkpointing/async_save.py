"""Asynchronous checkpoint saves: megatron-core's AsyncCallsQueue, made to work on CPU.

``dist_checkpointing.save(..., async_sharded_save=True)`` plans the save (collectively) and
returns an ``AsyncRequest`` whose write function runs in a background process while
training continues; its finalize functions (global metadata, then this package's commit:
completion marker, rename, tracker) run once every rank's writer has finished. This module
owns the per-process queue of those requests.

Which background process writes:

* with CUDA, megatron-core's own callers: ``PersistentAsyncCaller`` (one long-lived worker,
  ``checkpoint.use_persistent_ckpt_worker=True``) or ``TemporalAsyncCaller`` (a fork per
  save);
* without CUDA, ``use_persistent_ckpt_worker=False`` uses megatron's ``TemporalAsyncCaller``
  (the fork is the snapshot: the child sees the tensors as they were when it started), and
  ``use_persistent_ckpt_worker=True`` uses :class:`CpuPersistentAsyncCaller`, because
  megatron's persistent worker calls ``torch.cuda.set_device`` on start and receives CPU
  tensors by reference (training would change them while they are written). The CPU worker
  is forked once; each save copies the tensors to shared memory before handing them over.

Every call into megatron's queue runs inside :func:`core_utils.cpu_cuda_compat`, which makes
its ``torch.cuda.synchronize()`` / ``current_device()`` calls work without a GPU.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import logging
import multiprocessing as mp
import os
import queue as queue_module
from typing import TYPE_CHECKING, Any

import torch
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCaller, AsyncCallsQueue
from torch.distributed.checkpoint.api import CheckpointException

from bridge.train.checkpointing.errors import CheckpointError
from core_utils import cpu_cuda_compat

if TYPE_CHECKING:
    from bridge.resiliency import FaultTolerance

__all__ = [
    "BridgeAsyncCallsQueue",
    "CpuPersistentAsyncCaller",
    "ensure_write_results_queue",
    "finalize_async_saves",
    "get_async_calls_queue",
    "pending_async_saves",
]

logger = logging.getLogger(__name__)

# One queue per process: a forked child (a rank started from a parent that had one, a
# writer process) must not reuse its parent's, nor megatron's write-results queue or
# persistent writer.
_QUEUE: dict[str, Any] = {"queue": None}


def _forget_parent_queues() -> None:
    _QUEUE["queue"] = None
    filesystem_async._results_queue = None
    AsyncCallsQueue._persistent_caller = None


os.register_at_fork(after_in_child=_forget_parent_queues)


def ensure_write_results_queue() -> None:
    """Create dist_checkpointing's write-results queue for this process by forking.

    By default megatron-core creates it on the first save from a *spawn* context: a fresh
    interpreter that re-imports the main module, torch and megatron-core (about 100 s per
    rank on a loaded 2-core machine). A Manager forked from the already loaded process
    starts in a fraction of a second. Each process needs its own queue (ranks must not read
    each other's results), so a forked child forgets the one it inherited. Only done
    without CUDA: forking a process that initialised CUDA is not safe.
    """
    if not torch.cuda.is_available():
        filesystem_async.get_write_results_queue(mp_mode="fork")  # made only when there is none


_ALIGN = 64  # bytes; keeps every tensor in the arena aligned for any dtype


class _SharedArena:
    """One shared-memory buffer that holds a copy of every tensor of a save.

    Allocating shared memory is the expensive part (the kernel maps and zero-fills it), so
    the arena is kept and refilled by later saves of the same or a smaller size; only a
    save issued while the previous one is still being written needs a new one.
    """

    def __init__(self, nbytes: int) -> None:
        self.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8).share_memory_()
        self.busy_with: int | None = None  # call index whose write still reads the arena

    def copy_in(self, write_buckets: list[Any]) -> list[Any]:
        """Copy every tensor of dist_checkpointing's write buckets into the arena.

        Returns:
            The buckets with each tensor replaced by ``(offset, nbytes, dtype, shape)`` of
            its copy; :func:`_buckets_from_arena` turns them back into tensors.
        """
        offset = 0
        layout = []
        for file_name, storage_key, (bytes_data, tensor_data) in write_buckets:
            placed = []
            for item, tensor in tensor_data:
                size = tensor.numel() * tensor.element_size()
                view = self.buffer[offset : offset + size].view(tensor.dtype).view(tensor.shape)
                view.copy_(tensor.detach())
                placed.append((item, (offset, size, tensor.dtype, tuple(tensor.shape))))
                offset += -(-size // _ALIGN) * _ALIGN
            layout.append((file_name, storage_key, (bytes_data, placed)))
        return layout


def _buckets_from_arena(buffer: torch.Tensor, layout: list[Any]) -> list[Any]:
    """Write buckets with their tensors copied back out of ``buffer`` (the writer's side of
    :meth:`_SharedArena.copy_in`)."""
    buckets = []
    for file_name, storage_key, (bytes_data, placed) in layout:
        # Own storage per tensor: serialising a view would write the whole arena.
        tensors = [
            (item, buffer[offset : offset + size].view(dtype).view(shape).clone())
            for item, (offset, size, dtype, shape) in placed
        ]
        buckets.append((file_name, storage_key, (bytes_data, tensors)))
    return buckets


def _arena_bytes(write_buckets: list[Any]) -> int:
    return sum(
        -(-(tensor.numel() * tensor.element_size()) // _ALIGN) * _ALIGN
        for _, _, (_, tensor_data) in write_buckets
        for _, tensor in tensor_data
    )


def _writer_loop(requests: Any, completions: Any) -> None:
    """Body of the CPU persistent writer: run each request's write function in turn."""
    # Never collect what the training process left behind: its process groups' and stores'
    # destructors would wait here for threads this forked child does not have.
    gc.freeze()
    torch.set_num_threads(1)
    with contextlib.suppress(OSError):
        os.nice(10)  # training keeps priority over checkpoint writing
    with cpu_cuda_compat():
        while True:
            item = requests.get()
            if item is None:
                break
            call_idx, fn, args, kwargs, arena = item
            try:
                args[1] = _buckets_from_arena(arena, args[1])
                fn(*args, **kwargs)
                completions.put((call_idx, None))
            except BaseException as exc:  # reported to the training process
                completions.put((call_idx, f"{type(exc).__name__}: {exc}"))
            del item, fn, args, kwargs, arena


class CpuPersistentAsyncCaller(AsyncCaller):
    """One long-lived writer process per rank for asynchronous saves on CPU.

    A drop-in for megatron-core's ``PersistentAsyncCaller`` (same ``AsyncCaller`` contract:
    ``schedule_async_call``, ``is_current_async_call_done``, ``close``) that works without
    CUDA: the worker is forked (no re-import, no ``torch.cuda.set_device``), and each
    request's tensors are copied to shared memory before it is queued, so the checkpoint is
    the state at the time of the save. A failed or killed writer counts as finished; the
    save's finalization then finds its results missing and fails on every rank.

    The shared memory is allocated by the first save and reused by later ones (see
    :class:`_SharedArena`), so a steady-state save blocks training only for one memory copy
    of the state plus dist_checkpointing's planning.
    """

    def __init__(self) -> None:
        self._arena: _SharedArena | None = None
        self._process: Any = None
        self._requests: Any = None
        self._completions: Any = None
        self._in_flight: collections.deque[int] = collections.deque()
        self._finished: dict[int, str | None] = {}
        self._next_idx = 0

    def warmup(self) -> None:
        """Start the writer process now (before the model occupies memory), unless running."""
        if self._process is not None and self._process.is_alive():
            return
        ctx = mp.get_context("fork")
        self._requests = ctx.Queue()
        self._completions = ctx.Queue()
        self._process = ctx.Process(
            target=_writer_loop, args=(self._requests, self._completions), daemon=True
        )
        self._process.start()

    def schedule_async_call(self, async_req: Any) -> None:
        """Queue ``async_req``'s write function on the writer (its tensors are copied first)."""
        call_idx = self._next_idx
        self._next_idx += 1
        self._in_flight.append(call_idx)
        if async_req.async_fn is None:
            self._finish(call_idx, None)  # nothing to write on this rank
            return
        self.warmup()
        args = list(async_req.async_fn_args)
        # args are (rank, write_buckets, results_queue). A preload function would only move
        # CUDA tensors to the host; the shared-memory snapshot does that job here.
        needed = _arena_bytes(args[1])
        arena = self._arena
        if arena is None or arena.busy_with is not None or arena.buffer.numel() < needed:
            arena = self._arena = _SharedArena(needed)
        arena.busy_with = call_idx
        args[1] = arena.copy_in(args[1])
        self._requests.put(
            (call_idx, async_req.async_fn, args, dict(async_req.async_fn_kwargs), arena.buffer)
        )

    def _finish(self, idx: int, error: str | None) -> None:
        self._finished[idx] = error
        if self._arena is not None and self._arena.busy_with == idx:
            self._arena.busy_with = None  # the writer no longer reads it

    def _drain(self, current: int, blocking: bool) -> None:
        """Record finished writes until ``current`` has finished or, unless ``blocking``, no
        more are reported; a writer that died finishes ``current``."""
        while current not in self._finished:
            try:
                idx, error = self._completions.get(block=blocking, timeout=0.1)
            except queue_module.Empty:
                if not self._process.is_alive():
                    self._finish(current, f"writer exited with code {self._process.exitcode}")
                if blocking:
                    continue
                return
            self._finish(idx, error)
            if error is not None:
                logger.error("asynchronous checkpoint write %d failed: %s", idx, error)

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        """Whether the oldest queued write has finished on every rank.

        Collective (an all-reduce over the world) unless ``no_dist``.
        """
        current = self._in_flight[0] if self._in_flight else None
        if current is not None and self._process is not None:
            self._drain(current, blocking)
        alive = int(current is not None and current not in self._finished)
        done = not alive if no_dist else bool(self.sync_all_async_calls(alive))
        if done and current is not None:
            self._in_flight.popleft()
            self._finished.pop(current, None)
        return done

    def close(self, abort: bool = False) -> None:
        """Stop the writer (after the writes already queued, unless ``abort``)."""
        if self._process is None:
            return
        if abort:
            self._process.kill()
        else:
            self._requests.put(None)
        self._process.join(timeout=10 if abort else None)
        self._process = None

    def __del__(self) -> None:
        # Never block or communicate while being collected; the daemonic writer ends with
        # the training process.
        pass


class BridgeAsyncCallsQueue(AsyncCallsQueue):
    """megatron-core's ``AsyncCallsQueue`` with a CPU-capable persistent writer.

    Args:
        persistent: One long-lived writer process (megatron's ``PersistentAsyncCaller`` with
            CUDA, :class:`CpuPersistentAsyncCaller` without) instead of a fork per save.
    """

    def _get_async_caller(self) -> Any:
        if self.persistent and not torch.cuda.is_available():
            # megatron's slot for its persistent writer: its close() finalizes and stops it.
            if AsyncCallsQueue._persistent_caller is None:
                AsyncCallsQueue._persistent_caller = CpuPersistentAsyncCaller()
            return AsyncCallsQueue._persistent_caller
        return super()._get_async_caller()

    def warmup(self) -> None:
        """Start the CPU persistent writer now, while the process is still small to fork."""
        if self.persistent and not torch.cuda.is_available():
            self._get_async_caller().warmup()


def get_async_calls_queue(persistent: bool) -> Any:
    """This process's queue of asynchronous saves (created on first use).

    Asking for the other kind of writer than the existing queue has finalizes that queue's
    pending saves (collective) and replaces it.

    Args:
        persistent: Use one long-lived writer process (``use_persistent_ckpt_worker``).

    Returns:
        A megatron-core ``AsyncCallsQueue``.
    """
    current = _QUEUE["queue"]
    if current is not None and current.persistent != persistent:
        with cpu_cuda_compat():
            current.close()
        current = None
    if current is None:
        current = BridgeAsyncCallsQueue(persistent=persistent)
        _QUEUE["queue"] = current
    return current


def pending_async_saves() -> int:
    """Number of asynchronous saves of this process not yet finalized."""
    current = _QUEUE["queue"]
    return 0 if current is None else int(current.get_num_unfinalized_calls())


def finalize_async_saves(
    fault_tolerance: FaultTolerance | None = None,
    blocking: bool = False,
    terminate: bool = False,
) -> None:
    """Finalize asynchronous saves whose background writes have finished.

    Collective: every rank calls it at the same points (the training loop calls it every
    iteration non-blocking, and with ``blocking=True, terminate=True`` at exit). A finalized
    save gets its global metadata, completion marker and tracker; until then the previous
    checkpoint stays the newest.

    While a save is pending, finalizing it is a fault-tolerance checkpointing section
    marked as an asynchronous finalization (``fault_tolerance``), so a long wait at
    exit is timed against the checkpointing timeout, not the step timeout, and does not
    feed the computed step timeouts.

    Args:
        fault_tolerance: The run's fault-tolerance hooks, or ``None``.
        blocking: Wait for every pending save to finish, then finalize it.
        terminate: Also stop the background writer (implies ``blocking``); call at exit.

    Raises:
        CheckpointError: A background write or its finalization failed (on every rank);
            the previous checkpoint stays the newest. The queue is discarded.
    """
    current = _QUEUE["queue"]
    if current is None:
        return
    section: contextlib.AbstractContextManager[Any] = (
        fault_tolerance.checkpointing(async_finalization=True)
        if fault_tolerance is not None and current.get_num_unfinalized_calls() > 0
        else contextlib.nullcontext()
    )
    with section:
        try:
            with cpu_cuda_compat():
                if terminate:
                    _QUEUE["queue"] = None  # discarded however its close ends
                    current.close()
                else:
                    current.maybe_finalize_async_calls(blocking=blocking, no_dist=False)
        except CheckpointError:
            raise
        except (CheckpointException, Exception) as exc:  # torch's is a BaseException
            # Drop the failed queue, stopping its writer without finalizing anything.
            current.async_calls.clear()
            _QUEUE["queue"] = None
            with cpu_cuda_compat():
                current.close(abort=True)
            raise CheckpointError(
                f"an asynchronous checkpoint save failed: {exc}; the previous checkpoint "
                "remains the newest one (its tracker was not updated)"
            ) from exc
