"""Process-group, model-parallel and RNG initialisation for a training run.

Without CUDA the engine (:meth:`~bridge.train.engine.megatron.MegatronEngine.initialize_distributed`)
has :func:`initialize_distributed` enter :func:`core_utils.cuda_emulation` (megatron-core's
DDP, optimizers, pipeline schedules and RNG tracker assume CUDA); :func:`destroy_distributed`
exits it, so the emulation lasts exactly as long as the run. Code that only needs the
parallel state (the Hugging Face conversion) initialises without it.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.config import set_experimental_flag

from bridge.config import ConfigError, DistributedInitConfig, data_parallel_size
from bridge.resiliency import init_process_group
from bridge.train.engine.launch_env import adopt_launch_environment, guarded_rendezvous
from core_utils import cuda_emulation, cuda_emulation_active, set_experimental_enabled
from core_utils.distributed import global_world_size
from core_utils.testing import find_free_port

if TYPE_CHECKING:
    from bridge.config import ModelConfigProtocol, RNGConfig

__all__ = [
    "apply_experimental_flag",
    "destroy_distributed",
    "init_launch_process_group",
    "initialize_distributed",
    "resolve_distributed_backend",
    "resume_seed",
    "seed_from_rng_config",
    "seed_process_generators",
    "select_cuda_device",
    "start_process_group",
]

_STATE: dict[str, Any] = {"owns_process_group": False, "emulation": None}


def resolve_distributed_backend(dist_config: DistributedInitConfig | None = None) -> str:
    """The torch.distributed backend to use: the configured one, checked against the machine.

    Args:
        dist_config: ``DistributedInitConfig`` (``distributed_backend``: ``"nccl"``,
            ``"gloo"``, or ``None`` / ``"auto"`` for nccl with CUDA and gloo without).

    Returns:
        ``"nccl"`` or ``"gloo"``.

    Raises:
        bridge.config.ConfigError: (a ``ValueError``) Unknown backend, or nccl requested
            without CUDA; the launch checks run this as the ``dist`` section's rule.
    """
    backend = getattr(dist_config, "distributed_backend", None)
    backend = "auto" if backend is None else str(backend).lower()
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ConfigError("dist.distributed_backend", f"{backend!r} is not one of 'nccl', 'gloo'")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError(
            "dist.distributed_backend",
            "'nccl' requires CUDA, and no GPU is available; set "
            "dist.distributed_backend='gloo' to train on CPU",
        )
    return backend


def select_cuda_device(dist_config: DistributedInitConfig | None, backend: str) -> None:
    """Make this process's GPU the current CUDA device, for an nccl run on CUDA.

    The device is ``dist.local_rank`` (by default the launcher's; the launch checks refuse
    another value where the launcher gives one), or device 0 with
    ``dist.external_gpu_device_mapping`` (each process sees only its own GPU, e.g. through
    ``CUDA_VISIBLE_DEVICES``), modulo the visible device count. Both process-group starts
    (:func:`start_process_group`) choose it here. Without CUDA, or with gloo, nothing is set.

    Args:
        dist_config: The ``dist`` section (``None``: the launch's local rank).
        backend: The resolved backend (:func:`resolve_distributed_backend`).
    """
    if not (torch.cuda.is_available() and backend == "nccl"):
        return
    if getattr(dist_config, "external_gpu_device_mapping", False):
        local_rank = 0
    elif dist_config is None:
        local_rank = adopt_launch_environment().local_rank
    else:
        local_rank = dist_config.local_rank
    torch.cuda.set_device(local_rank % torch.cuda.device_count())


def apply_experimental_flag(dist_config: DistributedInitConfig | None) -> None:
    """Turn on megatron-core's and core-utils' experimental features with
    ``dist.enable_megatron_core_experimental``.

    Like megatron-training and Megatron-Bridge, only ever switches them on: with ``false``
    a flag set elsewhere (code, or ``CORE_UTILS_EXPERIMENTAL`` for core-utils) stays as it is.
    """
    if getattr(dist_config, "enable_megatron_core_experimental", False):
        set_experimental_flag(True)
        set_experimental_enabled(True)


def init_launch_process_group(backend: str, timeout: timedelta) -> None:
    """Create the default process group for this launch (:mod:`.launch_env`).

    Under torchrun, ``srun`` or torch's variables set by hand: the launch's rendezvous,
    restart-safe under ``torchrun --max-restarts`` (every restart attempt gets its own key
    space in the launcher's store) and guarded (a stuck rendezvous says what it waits for
    within seconds and ends in one line at ``timeout``). Launched bare: a one-rank group on
    a free local port.

    Args:
        backend: ``"gloo"`` or ``"nccl"`` (:func:`resolve_distributed_backend`).
        timeout: ``dist.distributed_timeout_minutes``.

    Raises:
        bridge.config.ConfigError: The launch environment cannot be a real launch.
        bridge.train.engine.launch_env.RendezvousTimeout: The ranks did not all meet.
    """
    launch = adopt_launch_environment()
    if not (launch.distributed and launch.world_size > 1):
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://127.0.0.1:{find_free_port()}",
            rank=0,
            world_size=1,
            timeout=timeout,
        )
        return

    guarded_rendezvous(
        launch,
        lambda: init_process_group(backend, timeout=timeout),
        timeout.total_seconds(),
        rendezvous_errors=(dist.DistError,),
    )


def start_process_group(dist_config: DistributedInitConfig | None) -> bool:
    """Start torch.distributed for this launch as the ``dist`` section says; True if this
    call created the default process group (an existing one is reused).

    In order: the backend (:func:`resolve_distributed_backend`), the experimental flag
    (:func:`apply_experimental_flag`), this process's GPU (:func:`select_cuda_device`), then
    the launch's group (:func:`init_launch_process_group`) with
    ``dist.distributed_timeout_minutes``. The GPT path (:func:`initialize_distributed`) and
    the ``mimo`` recipe both start their groups here.

    Args:
        dist_config: The ``dist`` section; ``None``: its defaults, with the machine's
            backend (nccl with CUDA, gloo without).

    Raises:
        bridge.config.ConfigError: Invalid backend, or a launch environment that cannot be
            a real launch.
        bridge.train.engine.launch_env.RendezvousTimeout: The ranks did not all meet.
    """
    backend = resolve_distributed_backend(dist_config)
    apply_experimental_flag(dist_config)
    select_cuda_device(dist_config, backend)
    if dist.is_initialized():
        return False
    init_launch_process_group(backend, timedelta(minutes=_timeout_minutes(dist_config)))
    return True


def _timeout_minutes(dist_config: DistributedInitConfig | None) -> int:
    """``dist.distributed_timeout_minutes`` (the section refuses values below 1)."""
    return int(getattr(dist_config, "distributed_timeout_minutes", 10))


def initialize_distributed(
    model_config: ModelConfigProtocol,
    dist_config: DistributedInitConfig | None = None,
    rng_config: RNGConfig | None = None,
    *,
    emulate_cuda: bool = False,
) -> None:
    """Initialise torch.distributed, megatron's parallel state and the random seeds.

    The process group is the launch's, started by :func:`start_process_group` (an existing
    default process group is reused; it also chooses the CUDA device and applies
    ``dist.enable_megatron_core_experimental``); ``dist.use_sharp`` and
    ``dist.high_priority_stream_groups`` go to megatron's ``initialize_model_parallel`` (the
    launch checks refuse them without nccl on CUDA).

    Args:
        model_config: The model config (its parallel sizes are used).
        dist_config: The ``dist`` section; ``None``: its defaults, with the machine's
            backend (nccl with CUDA, gloo without).
        rng_config: The ``rng`` section; seed 1234 when ``None``.
        emulate_cuda: Without CUDA, enter :func:`core_utils.cuda_emulation` for the rest of
            the run (until :func:`destroy_distributed`), once the layout is checked (the
            engine's choice; a bad layout then changes no process state).

    Raises:
        ValueError: Invalid backend, or (a :class:`~bridge.config.ConfigError`) parallel
            sizes that do not fit the world size (raised before any group is built).
        bridge.config.ConfigError: The launch environment cannot be a real launch.
        bridge.train.engine.launch_env.RendezvousTimeout: The ranks did not all meet.
    """

    adopt_launch_environment()  # srun's tasks: before the world size is read
    # ConfigContainer.validate() (the layout) and pretrain's launch checks (the backend,
    # checks/rules.py) refused a bad config already, before any process group exists; both
    # run again here because direct API users call this without them, and the backend's
    # value is needed here. Both are a few comparisons: a flag to skip them would cost more
    # code than it saves.
    backend = resolve_distributed_backend(dist_config)
    data_parallel_size(model_config, global_world_size(launcher_fallback=True))
    if emulate_cuda and _STATE["emulation"] is None:
        _STATE["emulation"] = stack = contextlib.ExitStack()
        stack.enter_context(cuda_emulation())  # a no-op with CUDA

    if start_process_group(dist_config):
        _STATE["owns_process_group"] = True

    if parallel_state.model_parallel_is_initialized():
        _destroy_model_parallel()
    order = "tp-pp-dp" if getattr(dist_config, "use_tp_pp_dp_mapping", False) else "tp-cp-ep-dp-pp"
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=model_config.tensor_model_parallel_size,
        pipeline_model_parallel_size=model_config.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=getattr(
            model_config, "virtual_pipeline_model_parallel_size", None
        ),
        context_parallel_size=model_config.context_parallel_size,
        expert_model_parallel_size=getattr(model_config, "expert_model_parallel_size", 1),
        expert_tensor_parallel_size=getattr(model_config, "expert_tensor_parallel_size", None),
        distributed_timeout_minutes=_timeout_minutes(dist_config),
        nccl_communicator_config_path=getattr(dist_config, "nccl_communicator_config_path", None),
        order=order,
        use_sharp=bool(getattr(dist_config, "use_sharp", False)),
        high_priority_stream_groups=getattr(dist_config, "high_priority_stream_groups", None),
        # On a gloo world the regular groups already are gloo groups (gloo has every
        # collective megatron-core uses: reduce-scatter, all-gather into a tensor, coalescing,
        # batched isend/irecv); duplicates would only cost time.
        create_gloo_process_groups=bool(getattr(dist_config, "use_gloo_process_groups", True))
        and backend == "nccl",
    )
    seed_from_rng_config(rng_config)


def seed_from_rng_config(rng_config: RNGConfig | None, iteration: int = 0) -> int:
    """Seed python, numpy and torch reproducibly for this rank from the ``rng`` section.

    The rank's seed is the base seed + ``100 * pipeline_rank`` (+ ``10 * data_parallel_rank``
    with ``rng.data_parallel_random_init``), so every data-parallel and tensor-parallel rank of
    a pipeline stage draws the same parameters (tensor-parallel ranks then slice the same full
    weights). On CUDA, and on CPU under :func:`core_utils.cuda_emulation` (the megatron
    engine), megatron's ``model_parallel_cuda_manual_seed`` also seeds its tensor-parallel
    RNG tracker (``rng.te_rng_tracker``, ``rng.inference_rng_tracker``; under the emulation
    its "CUDA" generator is the CPU generator); otherwise no CUDA state is touched.

    Args:
        rng_config: The ``rng`` section; None: seed 1234, the defaults.
        iteration: 0 for a fresh start. A resume under another parallel layout, whose saved
            generator states (per rank) cannot be restored, passes the iteration it
            continues from: the base seed becomes :func:`resume_seed` of the two, so the
            continuation is reproducible and does not replay the dropout masks a fresh
            start at this layout drew.

    Returns:
        The seed used on this rank.
    """
    # RNGConfig refuses a seed outside every generator's range when it is built.
    seed = int(getattr(rng_config, "seed", 1234))
    rank_seed = resume_seed(seed, iteration) if iteration else seed
    if parallel_state.model_parallel_is_initialized():
        rank_seed += 100 * parallel_state.get_pipeline_model_parallel_rank()
        if getattr(rng_config, "data_parallel_random_init", False):
            rank_seed += 10 * parallel_state.get_data_parallel_rank()
    seed_process_generators(rank_seed)

    if (torch.cuda.is_available() and torch.cuda.device_count() > 0) or cuda_emulation_active():
        tensor_parallel.model_parallel_cuda_manual_seed(
            rank_seed,
            te_rng_tracker=bool(getattr(rng_config, "te_rng_tracker", False)),
            inference_rng_tracker=bool(getattr(rng_config, "inference_rng_tracker", False)),
        )
    return rank_seed


# Below 2**31 with room for megatron's per-rank offsets (100 x pipeline rank, 2718 + tensor
# rank, expert ranks), which must stay valid seeds.
_RESUME_SEED_RANGE = 2**31 - 2**24


def resume_seed(seed: int, iteration: int) -> int:
    """The base seed of a run resumed at ``iteration`` under another parallel layout.

    A function of ``seed`` and ``iteration`` alone (a hash), so every rank of every layout
    agrees on it and two resumes of the same checkpoint draw the same.
    """
    digest = hashlib.sha256(f"bridge-train resume {seed} {iteration}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % _RESUME_SEED_RANGE


def seed_process_generators(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch's (CPU and every CUDA
    device) with ``seed``: what a checkpoint's RNG state holds, megatron's tracker aside.

    :func:`seed_from_rng_config` starts with it; a run without megatron's parallel state (the
    ``mimo`` recipe: one grid per module) seeds with it alone.
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _destroy_model_parallel() -> None:
    """megatron's ``destroy_model_parallel``, and the groups it leaves behind dropped too.

    megatron-core 0.19.2 leaves ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`` set. That group
    then outlives its process group, and a process forked later (a test's rank, a writer)
    that builds a parallel state of its own drops the inherited object and hangs in its
    destructor, which waits for threads only the parent has.
    """

    parallel_state.destroy_model_parallel()
    for name, value in list(vars(parallel_state).items()):
        if name.startswith("_") and isinstance(value, dist.ProcessGroup):
            setattr(parallel_state, name, None)


def destroy_distributed() -> None:
    """Tear down megatron's parallel state, the process group if this module created it, and
    the CUDA emulation if :func:`initialize_distributed` entered it."""

    try:
        if parallel_state.model_parallel_is_initialized():
            _destroy_model_parallel()
        if _STATE["owns_process_group"] and dist.is_initialized():
            dist.destroy_process_group()
        _STATE["owns_process_group"] = False
    finally:
        stack, _STATE["emulation"] = _STATE["emulation"], None
        if stack is not None:
            stack.close()
