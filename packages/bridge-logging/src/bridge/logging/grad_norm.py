"""Global and per-parameter L2 norms of the gradients of a (model-parallel) model."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from bridge.logging._dist import (
    collective_device,
    dist_ready,
    find_pg_collection,
    group_rank,
    group_size,
    pg_attr,
)


def _gradient(param: torch.nn.Parameter) -> torch.Tensor | None:
    # megatron's DDP accumulates into main_grad; plain torch into grad.
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def _all_reduce_sum(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    if group is None or not dist_ready() or group_size(group) == 1:
        return tensor
    moved = tensor.to(collective_device(group))
    dist.all_reduce(moved, op=dist.ReduceOp.SUM, group=group)
    return moved.cpu()


def report_l2_norm_grad(
    model: list[torch.nn.Module] | torch.nn.Module,
    *,
    mp_group: Any = None,
    tp_group: Any = None,
) -> dict[str, float]:
    """L2 norms of the gradients, per parameter and over the whole model.

    Call it after gradients are reduced across data-parallel ranks and unscaled. It reads
    ``param.main_grad`` (megatron DDP) or ``param.grad``; parameters without a gradient
    or with ``requires_grad=False`` are left out.

    ``l2_norm/grad/global`` is the norm over all parameters of all model chunks on all
    model-parallel ranks: parameters marked ``tensor_model_parallel=True`` (megatron's
    TP shards) count on every tensor-parallel rank, other parameters only on
    tensor-parallel rank 0 (they are replicas), parameters marked ``shared=True`` (the
    second copy of a tied embedding) not at all, and a parameter reachable from several
    chunks once. The squares are summed over ``mp_group``.

    ``l2_norm/grad/<name>`` is the norm of one parameter's gradient, summed over the
    tensor-parallel group for TP shards. With several chunks, names are prefixed
    ``chunk<i>.``. Each rank reports its own parameters (with pipeline parallelism the
    last rank reports the last stage's).

    A collective over ``mp_group`` and ``tp_group``: every rank of them must call it.

    Args:
        model: A module or a list of model chunks.
        mp_group: Model-parallel group (tensor x pipeline). Default: ``pg_collection.mp``
            of the model (megatron-core models keep their ``pg_collection``), else no
            reduction.
        tp_group: Tensor-parallel group. Default: ``pg_collection.tp`` of the model, else
            ``mp_group`` (exact when pipeline parallelism is off).

    Returns:
        ``{"l2_norm/grad/<name>": norm, ..., "l2_norm/grad/global": norm}`` as floats.
    """
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    pg = find_pg_collection(chunks) if mp_group is None or tp_group is None else None
    if mp_group is None:
        mp_group = pg_attr(pg, "mp")
    if tp_group is None:
        tp_group = pg_attr(pg, "tp") or mp_group
    first_tp_rank = group_rank(tp_group) == 0 if tp_group is not None else True

    names: list[str] = []
    squares: list[torch.Tensor] = []
    sharded: list[bool] = []
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
            is_shared = bool(getattr(param, "shared", False))
            names.append(prefix + name)
            squares.append(grad.detach().float().pow(2).sum().cpu())
            sharded.append(is_sharded)
            counted.append(not is_shared and (is_sharded or first_tp_rank))

    per_param = torch.stack(squares).double() if squares else torch.zeros(0, dtype=torch.float64)
    shard_mask = torch.tensor(sharded, dtype=torch.bool)
    count_mask = torch.tensor(counted, dtype=torch.bool)
    local_total = per_param[count_mask].sum().reshape(1)

    # Every rank of a TP group holds the same TP-sharded parameters in the same order (one
    # shard each), so one all-reduce of their squares completes all their norms at once.
    per_param[shard_mask] = _all_reduce_sum(per_param[shard_mask], tp_group)
    total = _all_reduce_sum(local_total, mp_group)

    report = {
        f"l2_norm/grad/{n}": float(v) ** 0.5 for n, v in zip(names, per_param.tolist(), strict=True)
    }
    report["l2_norm/grad/global"] = float(total.item()) ** 0.5
    return report
