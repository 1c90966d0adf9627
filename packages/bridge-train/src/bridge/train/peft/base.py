"""The PEFT contract: a transform applied to the built model before it is wrapped.

``ConfigContainer.peft`` accepts any object meeting :class:`bridge.config.PEFTProtocol`
(``peft(model, training=True) -> model``). The trainer applies it to every model chunk
before data-parallel wrapping (:func:`apply_peft`), then treats the parameters left
trainable as the adapters: only they reach the optimizer, and checkpoints hold only them
(the base comes from ``checkpoint.pretrained_checkpoint``). :class:`PEFT` is a base class
for transforms that act module by module (:class:`~bridge.train.peft.lora.LoRA` is one).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from bridge.config import PEFTProtocol
from bridge.train.peft.checkpoint import install_adapter_checkpointing

__all__ = ["PEFT", "apply_peft", "global_module_paths"]


class PEFT(ABC):
    """A module-by-module parameter-efficient transform.

    Calling it freezes every parameter of the model (and the MoE routers' expert-bias
    correction, which megatron would otherwise update every step), then calls
    :meth:`transform` on every submodule (parents before children; modules added by a
    transform are not visited); parameters a transform adds stay trainable.
    """

    @abstractmethod
    def transform(self, module: torch.nn.Module, name: str, prefix: str) -> torch.nn.Module:
        """Adapt one module (in place or by returning a replacement).

        Args:
            module: The module.
            name: Its attribute name in its parent (``"linear_qkv"``).
            prefix: Its dotted path in the model (``"decoder.layers.0.self_attention.linear_qkv"``),
                with global layer numbers: under pipeline parallelism a stage's first layer
                is named by its number in the whole model, so a path (and anything derived
                from it, such as LoRA's initialisation seed) means the same layer in every
                layout.

        Returns:
            The module to keep in its place.
        """

    def __call__(self, model: torch.nn.Module, training: bool = True) -> Any:
        """Freeze ``model`` (a module or a list of chunks) and adapt its submodules."""
        for chunk in model if isinstance(model, (list, tuple)) else [model]:
            for param in chunk.parameters():
                param.requires_grad_(False)
            for module in chunk.modules():
                # megatron's router updates its expert-bias correction (a buffer, DeepSeek-V3)
                # from the token counts every step unless frozen: it belongs to the frozen
                # base, and an adapter-only checkpoint would not keep it.
                if hasattr(module, "frozen_expert_bias"):
                    module.frozen_expert_bias = True
            global_paths = global_module_paths(chunk)
            for prefix, module in list(chunk.named_modules())[1:]:  # [0] is the chunk itself
                parent_name, _, name = prefix.rpartition(".")
                parent = chunk.get_submodule(parent_name)
                replacement = self.transform(module, name, global_paths[prefix])
                if replacement is not module:
                    setattr(parent, name, replacement)
            if not training:
                chunk.eval()
        return model


def global_module_paths(chunk: torch.nn.Module) -> dict[str, str]:
    """Every module path of ``chunk`` with each layer and expert index replaced by its global
    number: the path the module has in the one-process model (PEFT transforms and the
    Hugging Face conversion name modules by it).

    megatron numbers a pipeline stage's layers from 0 in module paths and keeps the global
    1-based number in the layer's ``layer_number``; its ``SequentialMLP`` numbers the experts
    of an expert-parallel rank from 0 (``local_experts.<i>``), the global number being the
    rank x ``num_local_experts`` + i. Its checkpoint keys use the global numbers of both.
    """
    modules = dict(chunk.named_modules())
    renamed: dict[str, str] = {}
    for path, module in modules.items():  # parents come before their children
        parent, _, name = path.rpartition(".")
        number = getattr(module, "layer_number", None)
        if isinstance(number, int) and name.isdigit():
            name = str(number - 1)
        elif name.isdigit() and parent.rpartition(".")[2] == "local_experts":
            experts = modules[parent.rpartition(".")[0]]
            group = getattr(experts, "ep_group", None)
            if group is not None:
                name = str(group.rank() * experts.num_local_experts + int(name))
        renamed[path] = f"{renamed[parent]}.{name}" if parent else name
    return renamed


def apply_peft(peft: PEFTProtocol, chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Apply ``peft`` to every chunk and record which parameters are adapters.

    Adapter parameters are those left trainable by the transform; each chunk's checkpoints
    then hold them only (adapter-only checkpoints).

    Args:
        peft: An object meeting ``bridge.config.PEFTProtocol``.
        chunks: Unwrapped model chunks.

    Returns:
        The transformed chunks.

    Raises:
        ValueError: The transform left no trainable parameter, or left every parameter
            trainable (nothing would be frozen: that is full finetuning, not PEFT).
    """
    out: list[torch.nn.Module] = []
    for index, chunk in enumerate(chunks):
        result = peft(chunk, training=True)
        chunk = result if isinstance(result, torch.nn.Module) else chunk
        names = [n for n, p in chunk.named_parameters() if p.requires_grad]
        if not names:
            raise ValueError(
                f"peft: {type(peft).__qualname__} left no trainable parameter in model chunk "
                f"{index}; check its target_modules"
            )
        if len(names) == len(list(chunk.parameters())):
            raise ValueError(
                f"peft: {type(peft).__qualname__} froze no parameter of model chunk {index}; a "
                "PEFT transform trains adapters on a frozen base (remove peft for full "
                "finetuning)"
            )
        install_adapter_checkpointing(chunk, frozenset(names))
        out.append(chunk)
    return out
