"""Sections that set up the process: random numbers, distributed init, the rerun machine."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from bridge.config._checks import at_least, within
from bridge.config._codec import normalize_fields
from bridge.config._errors import field_error
from bridge.config._fields import DEFAULT_DOC
from bridge.config._section import config_section

_SEED_LIMIT = 2**32 - 1  # numpy's seed range; torch and random accept it too


def _local_rank_from_env() -> int:
    """This process's rank on its node as its launcher gives it: ``$LOCAL_RANK`` (torchrun,
    or exported with torch's variables), else ``$SLURM_LOCALID`` (a task ``srun`` started:
    bridge-train exports it as ``LOCAL_RANK`` only when the launch starts), else 0."""
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        raw = os.environ.get(name)
        if raw is None:
            continue
        try:
            return int(raw)
        except ValueError:
            raise field_error(
                DistributedInitConfig,
                "local_rank",
                raw,
                f"the {name} environment variable must be an integer",
            ) from None
    return 0


@config_section
@dataclass(kw_only=True)
class RNGConfig:
    """Configuration settings for random number generation."""

    seed: int = 1234
    """Seed for Python's ``random``, numpy, torch and CUDA generators (0 to 2**32 - 1)."""

    te_rng_tracker: bool = False
    """Use Transformer Engine's random-number-generator tracker (needed for CUDA graphs)."""

    inference_rng_tracker: bool = False
    """Use a random-number-generator tracker set up for inference."""

    data_parallel_random_init: bool = False
    """Initialise parameters differently on each data-parallel rank instead of identically."""

    layout_independent_init: bool | None = None
    """Draw every initial weight from the seed and its global identity (checkpoint key and
    position), so the same seed gives bit-identical weights under every TP, PP, VPP, EP and
    DP size. ``true``: required (refused for a provider with a ``provide`` of its own);
    ``false``: megatron's per-stage seeding (weights depend on the layout); ``null``: on
    where the model is covered (every provider of bridge-train: GPT families, MoE, T5,
    hybrid Mamba, Gemma 3, MLA / DeepSeek-V3, gpt-oss; and the mimo recipe's modules),
    megatron's seeding elsewhere. See docs/checkpoints.md for its cost."""

    def __post_init__(self) -> None:
        """Check the field types, that the seed fits every generator and that the
        initialisation options agree."""
        normalize_fields(self)
        within(self, "seed", 0, _SEED_LIMIT, allow_none=False)
        if self.layout_independent_init and self.data_parallel_random_init:
            raise field_error(
                RNGConfig,
                "layout_independent_init",
                self.layout_independent_init,
                "the same weights on every layout and different weights per data-parallel "
                "rank (data_parallel_random_init=true) exclude each other: set one to false",
            )


@config_section
@dataclass(kw_only=True)
class DistributedInitConfig:
    """Configuration settings for distributed training initialization."""

    distributed_backend: Literal["nccl", "gloo"] = "nccl"
    """torch.distributed backend: ``"nccl"`` on GPUs, ``"gloo"`` on CPU."""

    distributed_timeout_minutes: int = 10
    """How long a collective may wait before torch.distributed gives up, in minutes."""

    align_grad_reduce: bool = True
    """With ``ddp.overlap_grad_reduce``: when true, the pipeline schedule launches each stage's
    gradient reduction when that stage's backward ends; when false, every stage launches its
    reductions from its own backward hooks, all at the same time (megatron's rule). The
    ``mimo`` recipe refuses false (it does not overlap gradient reduction)."""

    local_rank: int = field(
        default_factory=_local_rank_from_env,
        metadata={DEFAULT_DOC: "$LOCAL_RANK, else $SLURM_LOCALID, else 0"},
    )
    """Rank of this process on its node; with nccl on CUDA it picks the process's GPU (device
    ``local_rank`` modulo the visible device count; device 0 with
    ``external_gpu_device_mapping``). Default: the launcher's (torchrun's ``LOCAL_RANK``,
    srun's ``SLURM_LOCALID``, 0 started bare); a saved config leaves that value out, so each
    process that loads it takes its own. Where the launcher gives one, another value is
    refused (the config is the same on every process of a node, so they would share one
    GPU): set it only where the launcher gives none (one process started bare, or torch's
    variables exported without ``LOCAL_RANK``)."""

    lazy_init: bool = False
    """Skip data-parallel setup during initialisation and hand back a function that completes
    it, for an external DDP manager. Not supported by bridge-train: true is refused."""

    use_torch_fsdp2: bool = False
    """Shard parameters with torch's FSDP2. Not supported by bridge-train: true is refused
    (shard optimizer state with ``ddp.use_distributed_optimizer=true``)."""

    nccl_communicator_config_path: str | None = None
    """YAML file with per-communicator NCCL settings (``min_ctas``, ``max_ctas``,
    ``cga_cluster_size``). The ``mimo`` recipe refuses it."""

    use_tp_pp_dp_mapping: bool = False
    """Order ranks tensor-pipeline-data instead of tensor-data-pipeline. Do not combine with
    expert or context parallelism. The ``mimo`` recipe refuses it."""

    use_gloo_process_groups: bool = True
    """Also create gloo process groups next to the main backend's groups."""

    use_sharp: bool = False
    """Use SHARP for data-parallel collectives (runs a barrier in each data-parallel group to
    select the SHARP target groups). Needs CUDA and nccl: refused otherwise, and by the
    ``mimo`` recipe."""

    high_priority_stream_groups: list[str] | None = None
    """Names of communicator groups whose streams get high priority, so their kernels are
    scheduled ahead of overlapping compute. Needs CUDA and nccl: refused otherwise, and by
    the ``mimo`` recipe."""

    external_gpu_device_mapping: bool = False
    """GPU visibility is managed outside (for example with ``CUDA_VISIBLE_DEVICES`` per
    process): use device 0 instead of the local rank (modulo the visible device count)."""

    enable_megatron_core_experimental: bool = False
    """Turn on megatron-core's (and core-utils') experimental features when distributed
    setup starts; false leaves them as they are."""

    def __post_init__(self) -> None:
        """Check the field types, the timeout and the local rank."""
        normalize_fields(self)
        at_least(self, "distributed_timeout_minutes", 1, allow_none=False)
        at_least(self, "local_rank", 0, allow_none=False)

    @property
    def derived_fields(self) -> frozenset[str]:
        """``local_rank`` while it is the launcher's: a fact of this process, not of the run.

        ``bridge.config`` leaves it out of saved configs (a checkpoint's ``run_config.yaml``
        is written by rank 0 and loaded by every rank), so each process that loads one takes
        its own launcher's; a value set to another is saved.
        """
        return frozenset({"local_rank"} if self.local_rank == _local_rank_from_env() else ())


@config_section
@dataclass(kw_only=True)
class RerunStateMachineConfig:
    """Configuration for the rerun state machine used for result validation or stats."""

    error_injection_rate: int = 0
    """Inject an unexpected result once every this many result validations (0: never)."""

    error_injection_type: Literal["correct_result", "transient_error", "persistent_error"] = (
        "transient_error"
    )
    """Kind of error to inject when ``error_injection_rate`` is set."""

    rerun_mode: Literal["disabled", "validate_results", "report_stats"] = "disabled"
    """``"validate_results"`` re-runs steps to validate results; ``"report_stats"`` reports
    the variability that non-deterministic kernels cause; ``"disabled"`` does neither."""

    def __post_init__(self) -> None:
        """Check the field types and the injection rate."""
        normalize_fields(self)
        at_least(self, "error_injection_rate", 0, allow_none=False)
