"""Detect data-parallel replicas whose parameters have drifted apart."""

from __future__ import annotations

import ctypes
import hashlib
import logging

import torch
import torch.distributed as dist

from core_utils._megatron import initialized_parallel_state
from core_utils.distributed import collective_device, dist_ready

__all__ = ["check_param_hashes_across_dp_replicas", "param_sha1"]

logger = logging.getLogger(__name__)


def param_sha1(param: torch.Tensor) -> torch.Tensor:
    """Return the SHA-1 digest of a tensor's values (as float32) as 20 uint8 values."""
    data = param.detach().to("cpu", torch.float32).contiguous()
    # Hash the raw bytes in place (no numpy, which torch does not require).
    size = data.numel() * data.element_size()
    raw = ctypes.string_at(data.data_ptr(), size) if size else b""
    digest = hashlib.sha1(raw).digest()
    return torch.frombuffer(bytearray(digest), dtype=torch.uint8)


def _groups(
    dp_group: dist.ProcessGroup | None, expert_dp_group: dist.ProcessGroup | None
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """DP groups for regular and expert parameters (None: the world group)."""
    parallel_state = initialized_parallel_state()
    if dp_group is None and parallel_state is not None:
        dp_group = parallel_state.get_data_parallel_group()
    if expert_dp_group is None:
        if parallel_state is not None and dp_group is parallel_state.get_data_parallel_group():
            expert_dp_group = parallel_state.get_expert_data_parallel_group(check_initialized=False)
        if expert_dp_group is None:
            expert_dp_group = dp_group
    return dp_group, expert_dp_group


def check_param_hashes_across_dp_replicas(
    model: list[torch.nn.Module],
    cross_check: bool = False,
    *,
    dp_group: dist.ProcessGroup | None = None,
    expert_dp_group: dist.ProcessGroup | None = None,
) -> bool:
    """Check that every data-parallel replica holds the same parameter values.

    Each rank hashes every parameter (SHA-1 of its float32 values, computed on the CPU, so
    this is meant for occasional checks, not every step), the hashes are all-gathered over
    the data-parallel group, and compared. Parameters marked ``allreduce = False``
    (megatron's expert parameters) are compared over the expert data-parallel group. A
    collective: every rank of the groups must call it with the same model structure.

    Args:
        model: Model chunks whose parameters to check.
        cross_check: Compare against every replica instead of only DP rank 0.
        dp_group: Data-parallel group. Default: megatron's data-parallel group when its
            parallel_state is initialised, else the world group.
        expert_dp_group: Group for expert parameters. Default: megatron's expert
            data-parallel group when ``dp_group`` came from megatron, else ``dp_group``.

    Returns:
        True when this rank's hashes equal those of DP rank 0 (or of every replica with
        ``cross_check``); False otherwise, after logging each mismatching parameter's name.
        Always True without torch.distributed (a single replica).
    """
    if isinstance(model, torch.nn.Module):
        model = [model]
    regular: list[tuple[int, str]] = []
    regular_hashes: list[torch.Tensor] = []
    expert: list[tuple[int, str]] = []
    expert_hashes: list[torch.Tensor] = []
    for chunk_id, chunk in enumerate(model):
        for name, param in chunk.named_parameters():
            target, hashes = (regular, regular_hashes)
            if not getattr(param, "allreduce", True):
                target, hashes = (expert, expert_hashes)
            target.append((chunk_id, name))
            hashes.append(param_sha1(param))
    if not dist_ready():
        return True

    dp, expert_dp = _groups(dp_group, expert_dp_group)
    all_match = True
    for params, hashes, group in (
        (regular, regular_hashes, dp),
        (expert, expert_hashes, expert_dp),
    ):
        if not params:
            continue
        local = torch.stack(hashes).to(collective_device(group))
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, local, group=group)
        gathered = [g.cpu() for g in gathered]
        local = local.cpu()
        match_first = torch.equal(local, gathered[0])
        if not match_first:
            for i, (chunk_id, name) in enumerate(params):
                if not torch.equal(local[i], gathered[0][i]):
                    logger.warning(
                        "[rank %d] parameter %s of model chunk %d differs from DP rank 0",
                        dist.get_rank(),
                        name,
                        chunk_id,
                    )
        if cross_check:
            all_match &= all(torch.equal(local, other) for other in gathered)
        else:
            all_match &= match_first
    return all_match
