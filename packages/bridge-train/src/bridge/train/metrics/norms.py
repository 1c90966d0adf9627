"""Parameter norms that are correct under tensor, pipeline and expert parallelism."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

# megatron marks the copy of a tied word embedding on the last pipeline stage ``shared``;
# the norms skip it (megatron's param_is_not_shared) so that it is counted once.
from megatron.core.transformer.module import param_is_not_shared

from bridge.train.engine._distributed_utils import model_parallel_groups, unwrap_model_chunks
from core_utils.distributed import collective_device

if TYPE_CHECKING:
    from bridge.config import ModelConfigProtocol

__all__ = ["calc_dtensor_params_l2_norm", "calc_params_l2_norm", "param_is_not_shared"]


def _sum_of_squares(tensors: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for tensor in tensors:
        if tensor.numel():
            total += tensor.detach().to(device=device, dtype=torch.float64).pow(2).sum()
    return total


def _norm_source(param: torch.Tensor, bf16: bool, force_create_fp32_copy: bool) -> Any:
    """The tensor whose norm stands for ``param``: its fp32 main copy when it has one."""
    local = param.to_local() if hasattr(param, "to_local") else param
    main = getattr(param, "main_param", None)
    if bf16 and not force_create_fp32_copy and main is not None:
        return ("sharded" if getattr(param, "main_param_sharded", False) else "own", main)
    return ("own", local.data.float() if bf16 else local.data)


def calc_params_l2_norm(
    model: torch.nn.Module | list[torch.nn.Module],
    model_config: ModelConfigProtocol | None,
    use_megatron_fsdp: bool = False,
    force_create_fp32_copy: bool = False,
) -> float:
    """L2 norm of all model parameters over every rank of the job.

    Each parameter is counted exactly once: tensor-parallel shards are summed over the
    tensor-parallel group, replicas created by tensor parallelism (layer norms, biases of
    row-parallel layers) and parameters marked ``shared`` are skipped, pipeline stages
    are summed over the pipeline group, expert parameters over the expert
    tensor/model/pipeline group, and fp32 main parameters sharded by a distributed
    optimizer over the data-parallel group. With ``model_config.bf16`` the fp32 main copy
    (``param.main_param``) is used when present.

    Args:
        model: The model or its list of model chunks (wrapped or not).
        model_config: The model config; ``bf16`` is read from it.
        use_megatron_fsdp: Parameters are DTensors sharded by megatron FSDP; their norm is
            computed by :func:`calc_dtensor_params_l2_norm`.
        force_create_fp32_copy: Ignore ``main_param`` and compute the norm from an fp32 copy
            of each parameter.

    Returns:
        The global L2 norm as a Python float (the same value on every rank).
    """
    chunks = unwrap_model_chunks(model)
    if use_megatron_fsdp:
        return calc_dtensor_params_l2_norm([p for chunk in chunks for p in chunk.parameters()])

    bf16 = bool(getattr(model_config, "bf16", False))
    dense: list[torch.Tensor] = []
    expert: list[torch.Tensor] = []
    sharded_main: list[torch.Tensor] = []
    for chunk in chunks:
        for param in chunk.parameters():
            if not param_is_not_tensor_parallel_duplicate(param) or not param_is_not_shared(param):
                continue
            kind, tensor = _norm_source(param, bf16, force_create_fp32_copy)
            if kind == "sharded":
                sharded_main.append(tensor)
            elif getattr(param, "allreduce", True):
                dense.append(tensor)
            else:
                expert.append(tensor)

    pgc = model_parallel_groups(chunks)
    device = collective_device(pgc.mp)
    norm_2 = _sum_of_squares(dense, device)
    sharded_2 = _sum_of_squares(sharded_main, device)
    expert_2 = _sum_of_squares(expert, device)
    if dist.is_initialized():
        # Sharded main params: every data-parallel rank holds a different slice.
        dist.all_reduce(sharded_2, group=pgc.dp_cp)
        norm_2 += sharded_2
        dense_ranks = dist.get_process_group_ranks(pgc.mp)
        expert_ranks = dist.get_process_group_ranks(pgc.tp_ep_pp)
        if dense_ranks == expert_ranks:
            norm_2 += expert_2
            dist.all_reduce(norm_2, group=pgc.mp)
        else:
            dist.all_reduce(norm_2, group=pgc.mp)
            dist.all_reduce(expert_2, group=pgc.tp_ep_pp)
            norm_2 += expert_2
    else:
        norm_2 += sharded_2 + expert_2
    return float(norm_2.item()) ** 0.5


def calc_dtensor_params_l2_norm(params: Iterable[Any]) -> float:
    """L2 norm of DTensor parameters, summing shards over their sharded mesh dimensions.

    Local shards are grouped by their sharding spec; each group's squared norm is
    all-reduced over every mesh dimension the tensor is sharded on (replicated dimensions
    hold copies and are not summed).

    Args:
        params: DTensor parameters (``torch.distributed.tensor.DTensor``).

    Returns:
        The L2 norm as a Python float.

    Raises:
        TypeError: A parameter is not a DTensor.
        RuntimeError: A placement is neither shard nor replicate (for example partial).
    """
    by_spec: dict[Any, list[torch.Tensor]] = defaultdict(list)
    for param in params:
        spec = getattr(param, "_spec", None)
        if spec is None or not hasattr(param, "_local_tensor"):
            raise TypeError(
                f"calc_dtensor_params_l2_norm expects DTensor parameters, got {type(param).__name__}"
            )
        by_spec[spec].append(param._local_tensor)
    total = 0.0
    for spec, local_tensors in by_spec.items():
        mesh = spec.device_mesh
        device = torch.device(mesh.device_type) if mesh.device_type != "cuda" else None
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        norm_2 = _sum_of_squares(local_tensors, device)
        for dim, placement in enumerate(spec.placements):
            if placement.is_shard():
                dist.all_reduce(norm_2, group=mesh.get_group(dim))
            elif not placement.is_replicate():
                raise RuntimeError(
                    f"calc_dtensor_params_l2_norm: unsupported placement {placement} on mesh "
                    f"dimension {dim}; only Shard and Replicate are supported"
                )
        total += float(norm_2.item())
    return total**0.5
