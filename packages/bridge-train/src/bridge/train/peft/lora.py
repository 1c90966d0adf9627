"""LoRA adapters on megatron-core's column- and row-parallel linear layers.

``LoRA(target_modules=[...], dim, alpha, dropout)`` adds to each targeted layer ``W`` a
low-rank update: ``y = W x + (alpha / dim) * B A dropout(x)``, with ``A`` initialised
(``lora_A_init_method``) and ``B`` zero, so training starts from the base model exactly.
The base weights are frozen. Targets are the attribute names of megatron's GPT layers
(``linear_qkv`` (fused QKV), ``linear_proj``, ``linear_fc1``, ``linear_fc2``) or
``fnmatch`` patterns over the dotted module path.

Tensor parallelism, so that TP=N trains and saves what TP=1 does:

* column-parallel ``W`` (``[out/tp, in]``): ``A`` is a replicated ``[dim, in]``, ``B`` a
  column-parallel ``[out, dim]`` split like ``W`` (its input-gradient all-reduce sums the
  shards' contributions, so every rank gets the full, equal gradient of ``A``);
* row-parallel ``W`` (``[out, in/tp]``): ``A`` is a row-parallel ``[dim, in]`` (its output
  all-reduced), ``B`` a replicated ``[out, dim]``.

megatron's layers do the communication (and its backward), and their sharded state dicts
give adapter checkpoints the same global shapes at every TP size. The full ``A`` is drawn
from a generator seeded by ``seed`` and the module path (with global layer and expert
numbers, :func:`~bridge.train.peft.base.apply_peft`), then sliced, so every TP, PP and EP
size starts from the same adapters and the run's random stream is left untouched.

Mixture-of-experts layers: the default targets also match every expert's ``linear_fc1`` /
``linear_fc2`` (megatron-core's ``SequentialMLP``); an expert's adapter is built as an
expert layer (``is_expert``), so it is split and reduced like the expert it adapts and
expert parallelism gives each rank the adapters of its own experts.

The adapter lives in the layer as a child ``adapter`` (its forward added by a forward
hook), so the base layer's parameter names, and checkpoint keys, do not change: a base
checkpoint loads into a LoRA model as it is. :func:`merge_adapters` folds adapters into
the base weights (for export) and removes them.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.utils import (
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)

from bridge.train.peft.base import PEFT
from core_utils.model_wrapping import ModelOrChunks

__all__ = ["LoRA", "LoRAAdapter", "merge_adapters"]

DEFAULT_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def _no_init(_: torch.Tensor) -> None:
    """Leave the weight as allocated; the adapter sets it right after."""


def _seed_for(seed: int, prefix: str) -> int:
    digest = hashlib.sha256(f"{seed}:{prefix}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class LoRAAdapter(torch.nn.Module):
    """The low-rank branch of one parallel linear layer (see the module docstring).

    Args:
        base: A megatron ``ColumnParallelLinear`` or ``RowParallelLinear``.
        dim: Rank of the update.
        alpha: Scale numerator (the update is scaled by ``alpha / dim``).
        dropout: Dropout probability on the branch.
        dropout_position: ``"pre"`` (on the input) or ``"post"`` (on the branch output).
        a_init: ``"xavier"`` (normal, Xavier) or ``"kaiming"`` (uniform, as torch's Linear).
        seed: Seed of ``A``'s initialisation.
        prefix: The layer's dotted path (part of the seed).

    Raises:
        TypeError: ``base`` is neither a column- nor a row-parallel linear layer.
        ValueError: Sequence parallelism, or a gathered column output.
    """

    def __init__(
        self,
        base: Any,
        dim: int,
        alpha: float,
        dropout: float,
        dropout_position: str,
        a_init: str,
        seed: int,
        prefix: str,
    ) -> None:
        super().__init__()
        # Checked first: a module that is no parallel linear has no config to read either.
        if not isinstance(base, (ColumnParallelLinear, RowParallelLinear)):
            raise TypeError(
                f"LoRA target {prefix} is a {type(base).__name__}; LoRA adapts megatron "
                "ColumnParallelLinear / RowParallelLinear layers (the portable and local layer "
                "specs); choose other target_modules"
            )
        config = base.config
        if getattr(config, "sequence_parallel", False):
            raise ValueError(
                f"LoRA on {prefix}: sequence parallelism is not supported; set "
                "model.sequence_parallel=false"
            )
        tp_group = base.tp_group
        in_size, out_size = int(base.input_size), int(base.output_size)
        self.kind: Literal["column", "row"]
        # An expert's adapter is an expert parameter too: split over the expert
        # tensor-parallel group like its layer, its gradient reduced over the expert
        # data-parallel group (allreduce=False), communication left to the token dispatcher.
        common: dict[str, Any] = {
            "config": config,
            "init_method": _no_init,
            "bias": False,
            "is_expert": bool(getattr(base, "is_expert", False)),
        }
        if isinstance(base, ColumnParallelLinear):
            if base.gather_output:
                raise ValueError(f"LoRA on {prefix}: a gathered column output is not supported")
            self.kind = "column"
            self.linear_in: Any = torch.nn.Linear(
                in_size, dim, bias=False, dtype=config.params_dtype
            )
            self.linear_out: Any = ColumnParallelLinear(
                dim, out_size, gather_output=False, tp_group=tp_group, **common
            )
        else:
            if not base.input_is_parallel:
                raise ValueError(f"LoRA on {prefix}: a row-parallel input must be parallel")
            self.kind = "row"
            self.linear_in = RowParallelLinear(
                in_size,
                dim,
                input_is_parallel=True,
                skip_bias_add=True,
                tp_group=tp_group,
                **common,
            )
            self.linear_out = torch.nn.Linear(dim, out_size, bias=False, dtype=config.params_dtype)
        plain = self.linear_out if self.kind == "row" else self.linear_in
        base_allreduce = getattr(base.weight, "allreduce", None)
        if base_allreduce is not None:
            plain.weight.allreduce = base_allreduce
        generator = torch.Generator().manual_seed(_seed_for(seed, prefix))
        full_a = torch.empty(dim, in_size)
        if a_init == "xavier":
            torch.nn.init.xavier_normal_(full_a, generator=generator)
        else:
            torch.nn.init.kaiming_uniform_(full_a, a=math.sqrt(5), generator=generator)
        with torch.no_grad():
            if self.kind == "row":  # A is split over its input like the layer's weight
                full_a = full_a.chunk(tp_group.size(), dim=1)[tp_group.rank()]
            self.linear_in.weight.copy_(full_a)
            self.linear_out.weight.zero_()
        self.scale = float(alpha) / float(dim)
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        self.dropout_position = dropout_position
        self.tp_group: Any = tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The scaled low-rank update for input ``x`` (the layer's input)."""
        if self.dropout_position == "pre":
            x = self.dropout(x)
        hidden = self.linear_in(x)
        if isinstance(hidden, tuple):
            hidden = hidden[0]
        out = self.linear_out(hidden)
        if isinstance(out, tuple):
            out = out[0]
        if self.dropout_position == "post":
            out = self.dropout(out)
        return out * self.scale

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple[Any, ...] = (), metadata: Any = None
    ) -> dict[str, Any]:
        """megatron sharded tensors of ``A`` and ``B`` (TP-sharded as their layers are)."""
        # The parallel layer of the pair maps its own sharding; the plain one is replicated.
        parallel, plain = (
            ("linear_out", "linear_in") if self.kind == "column" else ("linear_in", "linear_out")
        )
        result = sharded_state_dict_default(
            getattr(self, parallel), f"{prefix}{parallel}.", sharded_offsets, metadata
        )
        result.update(
            make_sharded_tensors_for_checkpoint(
                getattr(self, plain).state_dict(prefix="", keep_vars=True),
                f"{prefix}{plain}.",
                {},
                sharded_offsets,
            )
        )
        return result

    def delta_weight(self) -> torch.Tensor:
        """``scale * B A`` for this rank's shard of the base weight."""
        a = self.linear_in.weight.detach()
        b = self.linear_out.weight.detach()
        return (b.float() @ a.float()) * self.scale


def _add_adapter_output(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> Any:
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + module.adapter(x).to(out.dtype), bias  # type: ignore[operator]


def _base_and_adapter_sharded_state_dict(
    module: torch.nn.Module,
    prefix: str = "",
    sharded_offsets: tuple[Any, ...] = (),
    metadata: Any = None,
) -> dict[str, Any]:
    # The base layer's own method maps every tensor of its state_dict with the base's
    # sharding; take the adapter out for it and add the adapter's own sharded tensors.
    adapter = module._modules.pop("adapter")
    try:
        result: dict[str, Any] = type(module).sharded_state_dict(  # type: ignore[attr-defined]
            module, prefix, sharded_offsets, metadata
        )
    finally:
        module._modules["adapter"] = adapter
    assert isinstance(adapter, LoRAAdapter)
    result.update(adapter.sharded_state_dict(f"{prefix}adapter.", sharded_offsets, metadata))
    return result


@dataclass
class LoRA(PEFT):
    """LoRA as a PEFT transform (fields follow Megatron-Bridge's ``LoRA``).

    Attributes:
        target_modules: Layer names (``linear_qkv``, ``linear_proj``, ``linear_fc1``,
            ``linear_fc2``) or ``fnmatch`` patterns over dotted module paths.
        dim: Rank of the update.
        alpha: The update is scaled by ``alpha / dim``.
        dropout: Dropout probability on the adapter branch.
        dropout_position: ``"pre"`` (input) or ``"post"`` (branch output).
        lora_A_init_method: ``"xavier"`` or ``"kaiming"``.
        lora_B_init_method: ``"zero"`` (the only choice: training starts from the base).
        seed: Seed of the adapters' initialisation.
    """

    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    dim: int = 32
    alpha: float = 32.0
    dropout: float = 0.0
    dropout_position: Literal["pre", "post"] = "pre"
    lora_A_init_method: Literal["xavier", "kaiming"] = "xavier"
    lora_B_init_method: Literal["zero"] = "zero"
    seed: int = 1234

    def __post_init__(self) -> None:
        """Check the field values (the message names the field)."""
        if self.dim < 1:
            raise ValueError(f"peft.dim must be >= 1, got {self.dim}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"peft.dropout must be in [0, 1), got {self.dropout}")
        if self.dropout_position not in ("pre", "post"):
            raise ValueError(
                f"peft.dropout_position must be 'pre' or 'post', got {self.dropout_position!r}"
            )
        if self.lora_A_init_method not in ("xavier", "kaiming"):
            raise ValueError(
                f"peft.lora_A_init_method must be 'xavier' or 'kaiming', got {self.lora_A_init_method!r}"
            )
        if self.lora_B_init_method != "zero":
            raise ValueError(
                f"peft.lora_B_init_method must be 'zero' (training starts from the base model), "
                f"got {self.lora_B_init_method!r}"
            )
        if not self.target_modules:
            raise ValueError("peft.target_modules is empty; name at least one layer")

    def transform(self, module: torch.nn.Module, name: str, prefix: str) -> torch.nn.Module:
        """Attach an adapter to ``module`` when it is targeted."""
        if hasattr(module, "adapter") or not any(
            name == target or fnmatch.fnmatchcase(prefix, target) for target in self.target_modules
        ):
            return module
        adapter = LoRAAdapter(
            module,
            self.dim,
            self.alpha,
            self.dropout,
            self.dropout_position,
            self.lora_A_init_method,
            self.seed,
            prefix,
        )
        module.add_module("adapter", adapter)
        handle = module.register_forward_hook(_add_adapter_output, with_kwargs=True)
        module._bridge_lora_hook = handle  # type: ignore[assignment]
        module.sharded_state_dict = _base_and_adapter_sharded_state_dict.__get__(module)
        return module

    def __call__(self, model: torch.nn.Module, training: bool = True) -> Any:
        """Freeze the model, attach adapters to the targets; refuse when none matched."""
        result = super().__call__(model, training)
        chunks = model if isinstance(model, (list, tuple)) else [model]
        if not any(isinstance(m, LoRAAdapter) for c in chunks for m in c.modules()):
            raise ValueError(
                f"peft.target_modules={self.target_modules} matched no layer; use "
                f"{DEFAULT_TARGETS} or patterns over module paths"
            )
        return result


def merge_adapters(model: ModelOrChunks) -> Any:
    """Fold every LoRA adapter into its base weight and remove it (in place).

    Afterwards the model is a plain megatron model (same parameter names as before LoRA)
    computing what base + adapters computed; with tensor parallelism every rank merges its
    own shard (call it on every rank of the tensor-parallel group). The base weights stay
    as they were (frozen or not).

    Args:
        model: A module, a DDP-wrapped chunk, or a list of chunks.

    Returns:
        ``model``.
    """
    chunks: list[Any] = [model] if isinstance(model, torch.nn.Module) else list(model)
    for chunk in chunks:
        for module in list(chunk.modules()):
            adapter = module._modules.get("adapter")
            if not isinstance(adapter, LoRAAdapter):
                continue
            weight = module.weight
            with torch.no_grad():
                weight.add_(adapter.delta_weight().to(weight.dtype))
            module._bridge_lora_hook.remove()
            del module._bridge_lora_hook
            del module._modules["adapter"]
            del module.sharded_state_dict
        inner = chunk
        while isinstance(inner, torch.nn.Module):
            # Drop what apply_peft installed (its ``_bridge_peft_*`` records and the chunk's
            # state-dict methods): the chunk is a plain model again.
            for name in [n for n in vars(inner) if n.startswith("_bridge_peft_")]:
                delattr(inner, name)
            for name in ("sharded_state_dict", "load_state_dict"):
                inner.__dict__.pop(name, None)
            inner = getattr(inner, "module", None)
    return model
