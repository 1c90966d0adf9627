"""A torch optimizer wrapped to megatron-core's optimizer contract, on any device.

megatron-core's ``FP32Optimizer`` / ``Float16OptimizerWithFloat16Params`` allocate their
bookkeeping tensors on CUDA. :class:`PortableOptimizer` is a ``MegatronOptimizer`` (so code
typed against megatron's optimizer accepts it) that keeps that contract on CPU and GPU:

* ``step() -> (update_successful, grad_norm, num_zeros_in_grad)``;
* the gradient norm is the true L2 norm over the whole model: tensor-parallel shards
  summed over the model-parallel group, tensor-parallel replicas and ``shared`` parameters
  counted once, expert parameters summed over their expert model-parallel group; clipping
  (``clip_grad``) uses it;
* ``param_groups`` come from megatron's own grouping (no weight decay on biases and 1-D
  parameters, ``wd_mult`` / ``lr_mult`` / ``max_lr`` / ``min_lr`` per group), so
  megatron-core's ``OptimizerParamScheduler`` drives them unchanged;
* bf16 / fp16 models get fp32 main parameters (``param.main_param``); fp16 gets dynamic (or
  static) loss scaling, and an update whose gradients are not finite is skipped;
* ``state_dict`` / ``load_state_dict``, and ``sharded_state_dict`` mapping every optimizer
  state tensor to its parameter's megatron sharding for dist_checkpointing.

Gradients are read from ``param.main_grad`` (the data-parallel wrapper's buffer) when
present, else from ``param.grad``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.optimizer.optimizer import MegatronOptimizer

from bridge.train.metrics.norms import param_is_not_shared
from core_utils.distributed import collective_device

__all__ = ["DynamicLossScaler", "PortableOptimizer", "build_portable_optimizer"]

_TP_ATTRIBUTES = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "shared",
    "shared_embedding",
    "allreduce",
    "sequence_parallel",
    "is_embedding_or_output_parameter",
    "average_gradients_across_tp_domain",
)


class DynamicLossScaler:
    """Loss scale for fp16 training (static when ``dynamic`` is false).

    The scale is multiplied by ``backoff_factor`` after ``hysteresis`` overflowing steps and
    by ``growth_factor`` after ``growth_interval`` consecutive clean steps, never going below
    ``min_scale``.

    Args:
        initial_scale: Starting loss scale.
        min_scale: Lower bound of the scale.
        growth_factor: Factor applied after ``growth_interval`` clean steps (> 1).
        backoff_factor: Factor applied on overflow (between 0 and 1).
        growth_interval: Clean steps between increases.
        hysteresis: Overflowing steps tolerated before backing off.
        dynamic: Update the scale; when false the scale stays ``initial_scale``.
        device: Device of the scale tensor.
    """

    def __init__(
        self,
        initial_scale: float,
        min_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        dynamic: bool = True,
        device: torch.device | str = "cpu",
    ) -> None:
        if initial_scale <= 0 or min_scale <= 0:
            raise ValueError(
                f"loss scale must be positive: initial_scale={initial_scale}, min_scale={min_scale}"
            )
        if not 0 < backoff_factor < 1 or growth_factor <= 1:
            raise ValueError(
                f"need 0 < backoff_factor < 1 and growth_factor > 1, got {backoff_factor}, {growth_factor}"
            )
        self._scale = torch.tensor([float(initial_scale)], dtype=torch.float32, device=device)
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.dynamic = dynamic
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    @property
    def scale(self) -> torch.Tensor:
        """The current loss scale (a 1-element fp32 tensor)."""
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        """``1 / scale``."""
        return self._scale.double().reciprocal().float()

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step that did (or did not) overflow."""
        if not self.dynamic:
            return
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.clamp(self._scale * self.backoff_factor, min=self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        """Scale and trackers."""
        return {
            "scale": self._scale.detach().cpu(),
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scale and trackers."""
        self._scale = state_dict["scale"].to(self._scale.device, torch.float32).reshape(1)
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])


def _make_main_param(param: torch.nn.Parameter) -> torch.nn.Parameter:
    main = torch.nn.Parameter(param.detach().clone().float(), requires_grad=param.requires_grad)
    for name in _TP_ATTRIBUTES:
        if hasattr(param, name):
            setattr(main, name, getattr(param, name))
    return main


class PortableOptimizer(MegatronOptimizer):
    """A torch optimizer behind megatron-core's ``MegatronOptimizer`` interface.

    Build it with :func:`build_portable_optimizer`.

    Args:
        optimizer: The torch optimizer over the main parameters.
        config: megatron's ``OptimizerConfig``.
        model_params: Model parameter of every optimizer parameter, in optimizer order.
        grad_scaler: Loss scaler for fp16, else ``None``.
        grad_stats_parallel_group: Group gradient statistics (norm, zeros) are summed over
            (default: megatron's model-parallel group).
        expert_grad_stats_parallel_group: Group expert-parameter statistics are summed over
            (default: megatron's expert tensor/model/pipeline group).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: Any,
        model_params: list[torch.nn.Parameter],
        grad_scaler: DynamicLossScaler | None = None,
        grad_stats_parallel_group: Any = None,
        expert_grad_stats_parallel_group: Any = None,
    ) -> None:
        super().__init__(optimizer, config, init_state_fn=lambda *_: None)
        self.is_stub_optimizer = False
        self.grad_scaler = grad_scaler
        main_params = [p for group in optimizer.param_groups for p in group["params"]]
        if len(main_params) != len(model_params):
            raise ValueError("PortableOptimizer: model_params must match the optimizer parameters")
        self._pairs = list(zip(model_params, main_params, strict=True))
        self.has_main_params = any(m is not p for p, m in self._pairs)
        if grad_stats_parallel_group is None or expert_grad_stats_parallel_group is None:
            from megatron.core import parallel_state

            if grad_stats_parallel_group is None:
                grad_stats_parallel_group = parallel_state.get_model_parallel_group()
            if expert_grad_stats_parallel_group is None:
                expert_grad_stats_parallel_group = (
                    parallel_state.get_expert_tensor_model_pipeline_parallel_group(
                        check_initialized=False
                    )
                    or grad_stats_parallel_group
                )
        self.grad_stats_parallel_group = grad_stats_parallel_group
        self.expert_grad_stats_parallel_group = expert_grad_stats_parallel_group
        device = main_params[0].device if main_params else torch.device("cpu")
        self._one = torch.ones(1, dtype=torch.float32, device=device)
        self.grad_norms_by_group: dict[str, float] = {}

    # -- parameters ---------------------------------------------------------------------
    def model_params(self) -> list[torch.nn.Parameter]:
        """The model parameters, in the order of :meth:`get_parameters` (optimizer order)."""
        return [p for p, _ in self._pairs]

    def param_names(self, model: Iterable[torch.nn.Module]) -> list[str | None]:
        """Name of every optimizer parameter in ``model`` (optimizer order).

        Optimizer state index ``i`` belongs to the parameter named ``param_names(model)[i]``;
        a checkpoint can store optimizer state under the parameter's name and sharding.

        Args:
            model: The model chunks the optimizer was built for.

        Returns:
            Fully qualified names (``None`` for a parameter not found in ``model``).
        """
        names: dict[int, str] = {}
        for index, chunk in enumerate(model):
            for name, param in chunk.named_parameters():
                names.setdefault(id(param), f"{index}.{name}" if index else name)
        return [names.get(id(p)) for p, _ in self._pairs]

    # -- gradients -----------------------------------------------------------------------
    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Move gradients to the main parameters, unscale them; True if any is not finite."""
        for model_param, main_param in self._pairs:
            grad = getattr(model_param, "main_grad", None)
            if grad is None:
                grad = model_param.grad
            if grad is None:
                main_param.grad = None
            elif main_param is model_param and grad.dtype == main_param.dtype:
                main_param.grad = grad
            else:
                main_param.grad = grad.detach().to(main_param.dtype)
        if self.grad_scaler is None:
            return False
        found_inf = torch.zeros(1, dtype=torch.float32, device=self._one.device)
        inv_scale = self.grad_scaler.inv_scale
        for main_param in self.get_parameters():
            if main_param.grad is not None:
                if not torch.isfinite(main_param.grad).all():
                    found_inf.fill_(1.0)
                main_param.grad.mul_(inv_scale.to(main_param.grad.device))
        found_inf = self._all_reduce_max(found_inf)
        overflow = bool(found_inf.item() > 0)
        self.grad_scaler.update(overflow)
        return overflow

    def _all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized():
            device = collective_device(self.grad_stats_parallel_group)
            moved = tensor.to(device)
            dist.all_reduce(moved, op=dist.ReduceOp.MAX, group=self.grad_stats_parallel_group)
            return moved
        return tensor

    def _stat_groups(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Gradients counted in grad statistics: (dense, expert)."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        dense: list[torch.Tensor] = []
        expert: list[torch.Tensor] = []
        for main_param in self.get_parameters():
            grad = main_param.grad
            if grad is None or not param_is_not_shared(main_param):
                continue
            if not param_is_not_tensor_parallel_duplicate(main_param):
                continue
            (dense if getattr(main_param, "allreduce", True) else expert).append(grad)
        return dense, expert

    def _reduce_stat(self, dense: torch.Tensor, expert: torch.Tensor) -> float:
        if not dist.is_initialized():
            return float((dense + expert).item())
        dense_group, expert_group = (
            self.grad_stats_parallel_group,
            self.expert_grad_stats_parallel_group,
        )
        device = collective_device(dense_group)
        dense, expert = dense.to(device), expert.to(device)
        if dist.get_process_group_ranks(dense_group) == dist.get_process_group_ranks(expert_group):
            total = dense + expert
            dist.all_reduce(total, group=dense_group)
            return float(total.item())
        dist.all_reduce(dense, group=dense_group)
        dist.all_reduce(expert, group=expert_group)
        return float((dense + expert).item())

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        """Global L2 norm of the gradients (see the module docstring for what is counted)."""
        dense, expert = self._stat_groups()
        device = self._one.device

        def sq(grads: list[torch.Tensor]) -> torch.Tensor:
            total = torch.zeros(1, dtype=torch.float64, device=device)
            for g in grads:
                total += g.detach().double().pow(2).sum().to(device)
            return total

        return self._reduce_stat(sq(dense), sq(expert)) ** 0.5

    @torch.no_grad()
    def clip_grad_norm(self, clip_grad: float) -> float:
        """Compute the global gradient norm and scale gradients to at most ``clip_grad``.

        Args:
            clip_grad: Maximum norm; ``<= 0`` disables clipping.

        Returns:
            The norm before clipping.
        """
        grad_norm = self.get_grad_norm()
        if clip_grad > 0.0 and math.isfinite(grad_norm):
            coeff = clip_grad / (grad_norm + 1.0e-6)
            if coeff < 1.0:
                for main_param in self.get_parameters():
                    if main_param.grad is not None:
                        main_param.grad.mul_(coeff)
        return grad_norm

    @torch.no_grad()
    def count_zeros(self) -> float:
        """Number of zero gradient entries over the whole model (counted like the norm)."""
        dense, expert = self._stat_groups()
        device = self._one.device

        def zeros(grads: list[torch.Tensor]) -> torch.Tensor:
            total = torch.zeros(1, dtype=torch.float64, device=device)
            for g in grads:
                total += (g.numel() - torch.count_nonzero(g)).to(device, torch.float64)
            return total

        return self._reduce_stat(zeros(dense), zeros(expert))

    # -- step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """Apply the torch optimizer and copy main parameters back into the model."""
        self.optimizer.step()
        if self.has_main_params:
            for model_param, main_param in self._pairs:
                if main_param is not model_param:
                    model_param.data.copy_(main_param.data)
        return True

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, float | None]:
        """One optimizer step.

        Gradients are unscaled (fp16), their global norm is computed and, with
        ``clip_grad > 0``, clipped; the update is skipped when gradients overflow under loss
        scaling, when the norm is not finite, or when it exceeds
        ``config.grad_norm_skip_threshold``, so non-finite values never reach the weights.

        Returns:
            ``(update_successful, grad_norm, num_zeros_in_grad)``; ``grad_norm`` is ``None``
            after a loss-scale overflow, ``num_zeros_in_grad`` is ``None`` unless
            ``config.log_num_zeros_in_grad``.
        """
        self.grad_norms_by_group = {}
        if self.prepare_grads():
            return False, None, None
        grad_norm = self.clip_grad_norm(self.config.clip_grad)
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        threshold = getattr(self.config, "grad_norm_skip_threshold", float("inf"))
        if not math.isfinite(grad_norm) or grad_norm > threshold:
            return False, grad_norm, num_zeros
        return self.step_with_ready_grads(), grad_norm, num_zeros

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``.grad`` of model and main parameters (the DDP buffer is zeroed separately)."""
        for model_param, main_param in self._pairs:
            for param in {id(model_param): model_param, id(main_param): main_param}.values():
                if param.grad is None:
                    continue
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.detach_()
                    param.grad.zero_()

    def get_loss_scale(self) -> torch.Tensor:
        """The current loss scale (1 without fp16 loss scaling)."""
        return self.grad_scaler.scale if self.grad_scaler is not None else self._one

    def reload_model_params(self, state_dict: Any = None) -> None:
        """Refresh the fp32 main parameters from the model parameters."""
        del state_dict
        with torch.no_grad():
            for model_param, main_param in self._pairs:
                if main_param is not model_param:
                    main_param.data.copy_(model_param.data)

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"optimizer": torch state dict, "grad_scaler": ..., "fp32_from_fp16_params": ...}``.

        ``fp32_from_fp16_params`` (present with fp32 main parameters) holds the main parameter
        of every optimizer parameter, grouped like ``optimizer.param_groups``.
        """
        state: dict[str, Any] = {
            "optimizer": self.optimizer.state_dict(),
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None,
        }
        if self.has_main_params:
            state["fp32_from_fp16_params"] = [
                list(g["params"]) for g in self.optimizer.param_groups
            ]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state dict from :meth:`state_dict` (or a bare torch optimizer state dict)."""
        if "optimizer" not in state_dict and "param_groups" in state_dict:
            state_dict = {"optimizer": state_dict, "grad_scaler": None}
        inner = dict(state_dict["optimizer"])
        inner["state"] = dict(inner["state"])
        if "common_step" in inner["state"]:
            self._restore_common_per_param_step(inner, inner["state"].pop("common_step"))
        if len(inner["param_groups"]) != len(self.optimizer.param_groups):
            inner["param_groups"] = self._filter_and_reorder_param_groups(
                self.optimizer.param_groups, inner["param_groups"]
            )
        self.optimizer.load_state_dict(inner)
        if self.grad_scaler is not None and state_dict.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        saved_main = state_dict.get("fp32_from_fp16_params")
        if saved_main is not None and self.has_main_params:
            with torch.no_grad():
                for group, saved in zip(self.optimizer.param_groups, saved_main, strict=True):
                    for current, value in zip(group["params"], saved, strict=True):
                        current.data.copy_(value.data if hasattr(value, "data") else value)
            for model_param, main_param in self._pairs:
                if main_param is not model_param:
                    model_param.data.copy_(main_param.data)

    def sharded_state_dict(
        self, model_sharded_state_dict: Any, is_loading: bool = False, metadata: dict | None = None
    ) -> dict[str, Any]:
        """Optimizer state as megatron sharded tensors following each parameter's sharding.

        Every per-parameter state tensor (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``,
        fp32 main parameters) is wrapped with the ``ShardedTensor`` of its model parameter
        from ``model_sharded_state_dict``, so dist_checkpointing saves and reshards it like
        the parameter. The per-parameter ``step`` is stored once as ``common_step``.

        Args:
            model_sharded_state_dict: The model's ``sharded_state_dict()``.
            is_loading: Initialise optimizer state first (so there is state to load into).
            metadata: Unused; accepted for megatron compatibility.

        Returns:
            A sharded state dict accepted by ``dist_checkpointing.save`` / ``load``.
        """
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            make_sharded_optimizer_tensor,
            optim_state_to_sharding_state,
        )

        del metadata
        if is_loading:
            self._init_state()
        state = self.state_dict()
        id_to_sharded = get_param_id_to_sharded_param_map(
            model_sharded_state_dict, self.model_params()
        )
        if self.has_main_params:
            state["fp32_from_fp16_params"] = [
                [
                    make_sharded_optimizer_tensor(
                        id_to_sharded[param_id], main, prefix="optimizer.state.fp32_param"
                    )
                    for param_id, main in zip(saved_group["params"], group_params, strict=True)
                ]
                for group_params, saved_group in zip(
                    state["fp32_from_fp16_params"], state["optimizer"]["param_groups"], strict=True
                )
            ]
        step = self._extract_common_per_param_step(state["optimizer"])
        optim_state_to_sharding_state(state["optimizer"], id_to_sharded, exclude_keys="step")
        if step:
            state["optimizer"]["state"]["common_step"] = step
        return state

    @torch.no_grad()
    def _init_state(self) -> None:
        """Create optimizer state for every parameter (a zero-gradient step with lr 0)."""
        saved_lrs = [group["lr"] for group in self.optimizer.param_groups]
        saved_grads = [p.grad for p in self.get_parameters()]
        for group in self.optimizer.param_groups:
            group["lr"] = 0.0
        for param in self.get_parameters():
            param.grad = torch.zeros_like(param)
        saved_params = [p.detach().clone() for p in self.get_parameters()]
        self.optimizer.step()
        for param, value, grad in zip(
            self.get_parameters(), saved_params, saved_grads, strict=True
        ):
            param.copy_(value)  # weight decay with lr 0 is a no-op, but be exact
            param.grad = grad
        for group, lr in zip(self.optimizer.param_groups, saved_lrs, strict=True):
            group["lr"] = lr


def build_portable_optimizer(
    model_chunks: list[torch.nn.Module],
    config: Any,
    *,
    config_overrides: dict[Any, Any] | None = None,
) -> PortableOptimizer:
    """Build a :class:`PortableOptimizer` for ``model_chunks`` from megatron's ``OptimizerConfig``.

    Parameter groups follow megatron-core exactly (``_get_param_groups`` with the standard
    overrides: no weight decay for biases and 1-D parameters, ``decoupled_lr`` for
    embedding/output parameters). ``optimizer="adam"`` builds ``torch.optim.AdamW`` (or
    ``Adam`` when ``decoupled_weight_decay`` is false) with ``adam_beta1/2`` and
    ``adam_eps``; ``optimizer="sgd"`` builds ``torch.optim.SGD`` with ``sgd_momentum``.
    bf16/fp16 parameters get fp32 main copies; ``config.fp16`` adds a loss scaler
    (``loss_scale`` static, else dynamic from ``initial_loss_scale``, ``min_loss_scale``,
    ``loss_scale_window``, ``hysteresis``).

    Args:
        model_chunks: The (wrapped) model chunks.
        config: megatron's ``OptimizerConfig``.
        config_overrides: Parameter-group overrides keyed by megatron ``ParamKey`` (default:
            megatron's standard overrides).

    Returns:
        The optimizer.

    Raises:
        ValueError: Unknown ``config.optimizer``, ``lr`` unset, a distributed optimizer
            requested, or no trainable parameters.
    """
    from megatron.core.optimizer import _get_param_groups, get_standard_config_overrides

    if config.lr is None:
        raise ValueError("optimizer.lr is not set; set optimizer.lr (for example 3e-4)")
    if getattr(config, "use_distributed_optimizer", False):
        raise ValueError(
            "optimizer.use_distributed_optimizer=True needs the megatron engine on CUDA "
            "(train.engine='megatron'); set it to False for the portable engine"
        )
    if config.fp16 and config.bf16:
        raise ValueError("optimizer.fp16 and optimizer.bf16 are both True; choose one")
    name = str(config.optimizer).lower()
    if name not in ("adam", "sgd"):
        raise ValueError(
            f"optimizer.optimizer={config.optimizer!r} is not supported by the portable engine; "
            "use 'adam' or 'sgd'"
        )
    if config_overrides is None:
        config_overrides = get_standard_config_overrides(config)
    param_groups = _get_param_groups(model_chunks, config, config_overrides)
    param_groups = [g for g in param_groups if g["params"]]
    if not param_groups:
        raise ValueError("build_portable_optimizer: the model has no trainable parameters")

    model_params: list[torch.nn.Parameter] = []
    for group in param_groups:
        main_params = []
        for param in group["params"]:
            model_params.append(param)
            if param.dtype in (torch.float16, torch.bfloat16):
                main = _make_main_param(param)
                param.main_param = main
                main_params.append(main)
            else:
                main_params.append(param)
        group["params"] = main_params

    optimizer: torch.optim.Optimizer
    if name == "adam":
        adam_cls = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam
        optimizer = adam_cls(
            param_groups,
            lr=config.lr,
            weight_decay=config.weight_decay,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
        )
    else:
        optimizer = torch.optim.SGD(
            param_groups,
            lr=config.lr,
            weight_decay=config.weight_decay,
            momentum=config.sgd_momentum,
        )

    scaler = None
    if config.fp16:
        device = model_params[0].device
        if config.loss_scale:
            scaler = DynamicLossScaler(config.loss_scale, dynamic=False, device=device)
        else:
            scaler = DynamicLossScaler(
                config.initial_loss_scale,
                min_scale=config.min_loss_scale,
                growth_interval=int(config.loss_scale_window),
                hysteresis=config.hysteresis,
                device=device,
            )
    return PortableOptimizer(optimizer, config, model_params, grad_scaler=scaler)
