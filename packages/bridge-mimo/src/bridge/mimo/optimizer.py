"""One optimizer per module, stepped as one, with a gradient norm over the whole model.

Every rank of a MIMO job holds the parameters of its own module(s) only. Gradient clipping
must still use the norm of the *whole* model's gradient (what a single process would
compute), so :class:`MultiModuleOptimizer` computes each module's norm over its
tensor-parallel shards, shares the per-module norms over the world, and clips every module
with the global norm. It follows megatron's optimizer contract: ``step()`` returns
``(update_successful, grad_norm, num_zeros_in_grad)``, and ``param_groups`` is what
megatron-core's ``OptimizerParamScheduler`` drives.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from bridge.mimo.infra import MegatronMIMOInfra
from bridge.mimo.parallel_utils import get_module_to_grid_tuple
from core_utils.distributed import collective_device

__all__ = ["MultiModuleOptimizer", "OptimizerFactory", "build_multimodule_optimizer"]

#: Builds the optimizer of one module: ``factory(module_name, trainable_parameters)``.
OptimizerFactory = Callable[[str, list[torch.nn.Parameter]], torch.optim.Optimizer]


def _is_tp_sharded(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


class MultiModuleOptimizer:
    """Per-module torch optimizers of this rank, with global-norm gradient clipping.

    ``step`` is collective over the world (the global norm is shared), so every rank calls it
    once per iteration, also ranks whose module has no trainable parameter. The torch
    optimizers update the module parameters directly (fp32 training); with megatron-core DDP
    modules the reduced ``main_grad`` is handed to them as ``.grad``.

    Args:
        optimizers: Module name -> optimizer over that module's parameters on this rank;
            only the modules this rank runs.
        infra: The job's infra.
        clip_grad: Clip the global gradient norm to this value; 0 disables clipping.

    Raises:
        ValueError: A module is not one this rank runs, or ``clip_grad`` is negative.
    """

    def __init__(
        self,
        optimizers: Mapping[str, torch.optim.Optimizer],
        infra: MegatronMIMOInfra,
        *,
        clip_grad: float = 0.0,
    ) -> None:
        if clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0 (0 disables clipping), got {clip_grad}")
        for name in optimizers:
            if name not in infra.participating_modules:
                raise ValueError(
                    f"optimizer given for module {name!r}, which this rank does not run "
                    f"(it runs {infra.participating_modules})"
                )
        self.optimizers = dict(optimizers)
        self.infra = infra
        self.clip_grad = float(clip_grad)
        self._module_order = list(infra.module_to_grid_map)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every parameter group of every module optimizer (live dicts)."""
        return [group for opt in self.optimizers.values() for group in opt.param_groups]

    def _params(self, name: str) -> Iterator[torch.nn.Parameter]:
        for group in self.optimizers[name].param_groups:
            yield from group["params"]

    @staticmethod
    def _grad(param: torch.Tensor) -> torch.Tensor | None:
        grad = getattr(param, "main_grad", None)
        return param.grad if grad is None else grad

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        """L2 norm of the gradient of the whole model (all modules). Collective (world)."""
        squares = torch.zeros(
            len(self._module_order), dtype=torch.float64, device=collective_device()
        )
        for index, name in enumerate(self._module_order):
            if name not in self.optimizers:
                continue
            sharded = torch.zeros((), dtype=torch.float64, device=squares.device)
            replicated = torch.zeros((), dtype=torch.float64, device=squares.device)
            for param in self._params(name):
                grad = self._grad(param)
                if grad is None:
                    continue
                value = grad.detach().double().pow(2).sum().to(squares.device)
                if _is_tp_sharded(param):
                    sharded += value
                else:
                    replicated += value
            pgs = self.infra.pg_collections[name]
            if pgs is not None and dist.get_world_size(pgs.tp) > 1:
                dist.all_reduce(sharded, group=pgs.tp)
            squares[index] = sharded + replicated
        # Every rank of a module holds the same value; ranks elsewhere hold 0.
        dist.all_reduce(squares, op=dist.ReduceOp.MAX)
        return float(squares.sum().sqrt())

    @torch.no_grad()
    def step(self) -> tuple[bool, float, int | None]:
        """Clip with the global norm and step every module optimizer. Collective (world).

        Returns:
            ``(update_successful, grad_norm, None)``. A non-finite norm skips the update on
            every rank (they all see the same norm) and reports ``False``.
        """
        for name in self.optimizers:
            for param in self._params(name):
                main_grad = getattr(param, "main_grad", None)
                if main_grad is not None:
                    # megatron-core DDP accumulates into main_grad; torch optimizers read .grad.
                    param.grad = main_grad.to(param.dtype)
        grad_norm = self.get_grad_norm()
        if not math.isfinite(grad_norm):
            return False, grad_norm, None
        if self.clip_grad > 0:
            coeff = self.clip_grad / (grad_norm + 1.0e-6)
            if coeff < 1.0:
                for name in self.optimizers:
                    for param in self._params(name):
                        if param.grad is not None:
                            param.grad.mul_(coeff)
        for opt in self.optimizers.values():
            opt.step()
        return True, grad_norm, None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every module optimizer."""
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """Per-module optimizer state dicts (only this rank's modules)."""
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load :meth:`state_dict` output saved by a rank that ran the same modules, or
        what megatron's ``dist_checkpointing.load`` returns for :meth:`sharded_state_dict`.

        Raises:
            KeyError: The state dict lacks one of this rank's modules.
        """
        for name, opt in self.optimizers.items():
            if name not in state_dict:
                raise KeyError(
                    f"optimizer state dict has no entry for module {name!r} (has "
                    f"{sorted(state_dict)}); it was saved by a rank running other modules"
                )
            saved = state_dict[name]
            if _COMMON_KEY in saved:
                saved = _torch_state_from_sharded(opt, saved)
            opt.load_state_dict(saved)

    def reload_model_params(self) -> None:
        """Nothing to refresh: the module optimizers update the model parameters directly
        (megatron's contract, called when a checkpoint is loaded without optimizer state)."""

    def sharded_state_dict(
        self,
        model_sharded_state_dict: Mapping[str, Any],
        is_loading: bool = False,
        metadata: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """This rank's optimizer state as megatron-core sharded state (for dist_checkpointing).

        Every per-parameter state tensor (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``,
        ...) is a ``ShardedTensor`` with its parameter's sharding from
        ``model_sharded_state_dict`` (tensor-parallel offsets, data-parallel replica ids of
        the module's own grid), so it reshards with the model when the layout changes. What
        is not shaped like its parameter (Adam's ``step``, hyper-parameters of the groups) is
        one ``ShardedObject`` per module, written by the module's first rank: ranks of other
        modules hold other groups, so it cannot be the checkpoint's common state.

        Args:
            model_sharded_state_dict: The model's ``sharded_state_dict()`` on this rank.
            is_loading: Build the template to load into (creates state first when the
                optimizers have none yet).
            metadata: Unused; accepted for megatron's optimizer contract.

        Returns:
            Module name -> ``{"state": ..., "common": ShardedObject}``.

        Raises:
            ValueError: An optimizer parameter is not in ``model_sharded_state_dict``.
        """
        from megatron.core.dist_checkpointing.mapping import ShardedObject
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            make_sharded_optimizer_tensor,
        )

        del metadata
        result: dict[str, Any] = {}
        rank = dist.get_rank()
        for name, opt in self.optimizers.items():
            if is_loading:
                _create_state(opt)
            torch_state = opt.state_dict()
            params = list(self._params(name))
            id_to_sharded = get_param_id_to_sharded_param_map(model_sharded_state_dict, params)
            sharded: dict[int, dict[str, Any]] = {}
            per_param: dict[int, dict[str, Any]] = {}
            for param_id, param_state in torch_state["state"].items():
                if param_id not in id_to_sharded:
                    raise ValueError(
                        f"module {name!r}: optimizer parameter {param_id} is not in the model's "
                        "sharded state dict; build the optimizer over the model's own parameters"
                    )
                model_param = id_to_sharded[param_id]
                for key, value in param_state.items():
                    if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(
                        model_param.local_shape
                    ):
                        sharded.setdefault(param_id, {})[key] = make_sharded_optimizer_tensor(
                            model_param, value, prefix=f"optimizer.state.{key}"
                        )
                    else:
                        per_param.setdefault(param_id, {})[key] = value
            groups = [
                {k: v for k, v in group.items() if k != "params"}
                for group in torch_state["param_groups"]
            ]
            placement = self.infra.layout.modules[name]
            common = {"param_groups": groups, "per_param": per_param}
            result[name] = {
                "state": sharded,
                _COMMON_KEY: ShardedObject(
                    f"optimizer.module_state.{name}",
                    common,
                    (1,),
                    (0,),
                    # Every rank of the module holds the same values: its first rank writes.
                    replica_id=rank - placement.rank_offset,
                ),
            }
        return result


_COMMON_KEY = "common"


def _torch_state_from_sharded(
    optimizer: torch.optim.Optimizer, loaded: Mapping[str, Any]
) -> dict[str, Any]:
    """A torch optimizer state dict from a loaded :meth:`MultiModuleOptimizer.sharded_state_dict`."""
    common = loaded[_COMMON_KEY]
    current = optimizer.state_dict()["param_groups"]
    if len(common["param_groups"]) != len(current):
        raise ValueError(
            f"the checkpoint's optimizer has {len(common['param_groups'])} parameter groups, "
            f"this one {len(current)}; build the optimizer as the saved run did"
        )
    state: dict[int, dict[str, Any]] = {}
    for param_id, values in loaded["state"].items():
        state.setdefault(int(param_id), {}).update(values)
    for param_id, values in common["per_param"].items():
        state.setdefault(int(param_id), {}).update(values)
    groups = [
        {**saved, "params": list(group["params"])}
        for saved, group in zip(common["param_groups"], current, strict=True)
    ]
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def _create_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its per-parameter state (a zero-gradient step with lr 0), so
    there are tensors for a checkpoint load to fill; parameters and gradients are kept."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if all(len(optimizer.state.get(p, {})) > 0 for p in params):
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    grads = [p.grad for p in params]
    values = [p.detach().clone() for p in params]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    for param, value, grad in zip(params, values, grads, strict=True):
        param.copy_(value)  # exact even where lr 0 is not a no-op (e.g. float noise)
        param.grad = grad
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr


def build_multimodule_optimizer(
    model: torch.nn.Module,
    infra: MegatronMIMOInfra,
    factory: OptimizerFactory,
    *,
    clip_grad: float = 0.0,
) -> MultiModuleOptimizer:
    """Build one optimizer per module this rank runs.

    Args:
        model: The (possibly wrapped) MimoModel.
        infra: The job's infra.
        factory: ``factory(module_name, params) -> torch.optim.Optimizer``; ``params`` are the
            module's trainable parameters on this rank (tensor-parallel shards included).
        clip_grad: Global gradient-norm clipping threshold; 0 disables.

    Returns:
        The optimizer.

    Raises:
        TypeError: The factory returned something that is not a torch optimizer.
    """
    optimizers: dict[str, torch.optim.Optimizer] = {}
    pairs = get_module_to_grid_tuple(model, infra)
    names = [n for n in infra.module_to_grid_map if n in infra.participating_modules]
    for name, (module, _grid) in zip(names, pairs, strict=True):
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            continue
        opt = factory(name, params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer factory returned {type(opt).__name__} for module {name!r}; it must "
                f"return a torch.optim.Optimizer"
            )
        optimizers[name] = opt
    return MultiModuleOptimizer(optimizers, infra, clip_grad=clip_grad)
