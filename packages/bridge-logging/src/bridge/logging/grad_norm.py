"""Global and per-parameter L2 norms of the gradients of a (model-parallel) model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from bridge.logging._dist import find_pg_collection, pg_attr
from core_utils.distributed import collective_device, global_world_size
from core_utils.process_groups import get_pg_rank, get_pg_size

__all__ = ["report_l2_norm_grad"]


def _gradient(param: torch.nn.Parameter) -> torch.Tensor | None:
    # megatron's DDP accumulates into main_grad; plain torch into grad.
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def _all_reduce_sum(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    if get_pg_size(group) == 1:  # also without a group or without torch.distributed
        return tensor
    moved = tensor.to(collective_device(group))
    dist.all_reduce(moved, op=dist.ReduceOp.SUM, group=group)
    return moved.cpu()


def _is_expert(param: torch.nn.Parameter) -> bool:
    # megatron-core marks parameters reduced over the expert data-parallel group so.
    return not getattr(param, "allreduce", True)


@dataclass(frozen=True)
class _Groups:
    """The process groups of one norm computation (``None``: no reduction)."""

    mp: Any
    tp: Any
    expert_tp: Any
    expert_mp: Any


def _resolve_groups(
    chunks: list[Any],
    pg_collection: Any,
    mp_group: Any,
    tp_group: Any,
    expert_tp_group: Any,
    expert_mp_group: Any,
) -> _Groups:
    explicit = (mp_group, tp_group, expert_tp_group, expert_mp_group)
    pg = pg_collection
    if pg is None and any(group is None for group in explicit):
        pg = find_pg_collection(chunks)
    mp = mp_group if mp_group is not None else pg_attr(pg, "mp")
    tp = tp_group if tp_group is not None else pg_attr(pg, "tp")
    expert_tp = expert_tp_group if expert_tp_group is not None else pg_attr(pg, "expt_tp")
    if expert_tp is None:
        expert_tp = tp  # megatron-core's own fallback: expert TP is the dense TP
    expert_mp = expert_mp_group if expert_mp_group is not None else pg_attr(pg, "tp_ep_pp")
    if tp is None and mp is not None and get_pg_size(mp) > 1:
        raise ValueError(
            f"report_l2_norm_grad: the model-parallel group has {get_pg_size(mp)} ranks but no "
            "tensor-parallel group is known, so tensor-parallel replicas cannot be told from "
            "shards; pass tp_group=<the tensor-parallel group> (pg_collection.tp), or "
            "pg_collection=<the model's ProcessGroupCollection> with .mp and .tp"
        )
    if mp is None and tp is not None and get_pg_size(tp) > 1:
        raise ValueError(
            f"report_l2_norm_grad: tp_group has {get_pg_size(tp)} ranks but no model-parallel "
            "group is known to sum the norm over; pass mp_group=<the model-parallel group> "
            "(pg_collection.mp: tensor x pipeline parallel), or pg_collection=... with .mp"
        )
    return _Groups(mp=mp, tp=tp, expert_tp=expert_tp, expert_mp=expert_mp)


def report_l2_norm_grad(
    model: list[torch.nn.Module] | torch.nn.Module,
    *,
    mp_group: Any = None,
    tp_group: Any = None,
    pg_collection: Any = None,
    expert_tp_group: Any = None,
    expert_mp_group: Any = None,
) -> dict[str, float]:
    """L2 norms of the gradients, per parameter and over the whole model.

    Call it after gradients are reduced across data-parallel ranks and unscaled. It reads
    ``param.main_grad`` (megatron DDP) or ``param.grad``; parameters without a gradient
    or with ``requires_grad=False`` are left out.

    ``l2_norm/grad/global`` is the norm over all parameters of all model chunks on all
    model-parallel ranks, counted as megatron-core's optimizer counts them for gradient
    clipping. Dense parameters: their squares are summed over the model-parallel group
    (``mp``); TP shards (``tensor_model_parallel=True``) count on every tensor-parallel
    rank, other parameters only on tensor-parallel rank 0 (they are replicas). Expert
    parameters (megatron marks them ``allreduce=False``): summed over the expert
    tensor x expert x pipeline group (``tp_ep_pp``), replicas counted on expert
    tensor-parallel rank 0 only (``expt_tp``). Parameters marked ``shared=True`` (the
    second copy of a tied embedding) are not counted, and a parameter reachable from
    several chunks counts once.

    ``l2_norm/grad/<name>`` is the norm of one parameter's gradient, summed over the
    tensor-parallel group for TP shards (the expert tensor-parallel group for expert
    shards). With several chunks, names are prefixed ``chunk<i>.``. Each rank reports its
    own parameters: with pipeline parallelism the last rank reports the last stage's, with
    expert parallelism its own local experts.

    Groups: an explicit argument wins, then the attribute of ``pg_collection``, then of
    the ``pg_collection`` a megatron-core model carries (looked up through ``.module``
    wrappers); a group that is none of these means no reduction over it. Any object with
    the attributes ``mp``, ``tp``, ``expt_tp`` and ``tp_ep_pp`` serves as a collection
    (megatron-core's ``ProcessGroupCollection`` does).

    A collective over the groups used: every rank of them must call it.

    Args:
        model: A module or a list of model chunks.
        mp_group: Model-parallel group (tensor x pipeline; ``pg_collection.mp``).
        tp_group: Tensor-parallel group (``pg_collection.tp``). Required when the
            model-parallel group has more than one rank.
        pg_collection: Process groups to take the others from (default: the model's).
        expert_tp_group: Expert tensor-parallel group (``pg_collection.expt_tp``);
            default: the tensor-parallel group, as in megatron-core.
        expert_mp_group: Expert tensor x expert x pipeline group
            (``pg_collection.tp_ep_pp``). Required when the model has expert parameters
            and torch.distributed runs more than one rank.

    Returns:
        ``{"l2_norm/grad/<name>": norm, ..., "l2_norm/grad/global": norm}`` as floats.

    Raises:
        ValueError: A group needed for an exact norm is missing (the message names the
            argument to pass): the tensor-parallel group when the model-parallel group
            has several ranks, the model-parallel group when the tensor-parallel group
            has, or the expert group when expert parameters are present under
            torch.distributed with several ranks.
    """
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    groups = _resolve_groups(
        chunks, pg_collection, mp_group, tp_group, expert_tp_group, expert_mp_group
    )
    # get_pg_rank is 0 without a group (or without torch.distributed): that rank is first.
    first_tp_rank = get_pg_rank(groups.tp) == 0
    first_expert_tp_rank = get_pg_rank(groups.expert_tp) == 0

    names: list[str] = []
    squares: list[torch.Tensor] = []
    sharded: list[bool] = []
    expert: list[bool] = []
    counted: list[bool] = []
    seen: set[int] = set()
    for index, chunk in enumerate(chunks):
        prefix = f"chunk{index}." if len(chunks) > 1 else ""
        for name, param in chunk.named_parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            grad = _gradient(param)
            if not param.requires_grad or grad is None:
                continue
            is_sharded = bool(getattr(param, "tensor_model_parallel", False))
            is_expert = _is_expert(param)
            first_rank = first_expert_tp_rank if is_expert else first_tp_rank
            names.append(prefix + name)
            squares.append(grad.detach().float().pow(2).sum().cpu())
            sharded.append(is_sharded)
            expert.append(is_expert)
            counted.append(not getattr(param, "shared", False) and (is_sharded or first_rank))

    if any(expert) and groups.expert_mp is None and global_world_size() > 1:
        raise ValueError(
            "report_l2_norm_grad: the model has expert parameters (allreduce=False) but no "
            "expert model-parallel group is known to sum their norm over; pass "
            "expert_mp_group=<the expert tensor x expert x pipeline group> "
            "(pg_collection.tp_ep_pp), or pg_collection=... with .tp_ep_pp"
        )

    per_param = torch.stack(squares).double() if squares else torch.zeros(0, dtype=torch.float64)
    expert_mask = torch.tensor(expert, dtype=torch.bool)
    shard_mask = torch.tensor(sharded, dtype=torch.bool)
    count_mask = torch.tensor(counted, dtype=torch.bool)
    dense_total = per_param[count_mask & ~expert_mask].sum().reshape(1)
    expert_total = per_param[count_mask & expert_mask].sum().reshape(1)

    # Every rank of a TP group holds the same TP-sharded parameters in the same order (one
    # shard each), and every rank of an expert TP group the same expert shards, so one
    # all-reduce per group completes all their norms at once.
    if groups.expert_tp is groups.tp:
        per_param[shard_mask] = _all_reduce_sum(per_param[shard_mask], groups.tp)
    else:
        dense_shards, expert_shards = shard_mask & ~expert_mask, shard_mask & expert_mask
        per_param[dense_shards] = _all_reduce_sum(per_param[dense_shards], groups.tp)
        per_param[expert_shards] = _all_reduce_sum(per_param[expert_shards], groups.expert_tp)

    if groups.expert_mp is None or groups.expert_mp is groups.mp:
        total = _all_reduce_sum(dense_total + expert_total, groups.mp)
    else:
        total = _all_reduce_sum(dense_total, groups.mp) + _all_reduce_sum(
            expert_total, groups.expert_mp
        )

    report = {
        f"l2_norm/grad/{n}": float(v) ** 0.5 for n, v in zip(names, per_param.tolist(), strict=True)
    }
    report["l2_norm/grad/global"] = float(total.item()) ** 0.5
    return report
