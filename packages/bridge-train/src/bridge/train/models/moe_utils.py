"""Mixture-of-experts helpers for model chunks."""

from __future__ import annotations

import torch

from bridge.train.engine._distributed_utils import unwrap_model_chunks

__all__ = ["freeze_moe_router"]

# (submodule of the MoE layer, parameters frozen in it)
_ROUTER_PARAMETERS = (
    ("router", ("weight", "bias")),
    ("shared_experts", ("gate_weight", "gate_bias")),
)


def freeze_moe_router(model: list[torch.nn.Module] | torch.nn.Module) -> list[torch.nn.Module]:
    """Freeze MoE router and shared-expert gate parameters in model chunks.

    For every decoder layer whose ``mlp`` is a MoE layer, ``mlp.router.weight``/``bias`` and
    ``mlp.shared_experts.gate_weight``/``gate_bias`` (where present) get
    ``requires_grad=False``. Call it before the model is wrapped for data parallelism and
    before the optimizer is built, so frozen parameters get no gradient buffer and no
    optimizer state. Wrapped chunks (``.module``) are unwrapped.

    Args:
        model: Single megatron module or list of virtual-pipeline model chunks.

    Returns:
        The normalized model chunk list with router parameters frozen in place.
    """
    chunks = unwrap_model_chunks(model)
    for chunk in chunks:
        inner = chunk
        while not hasattr(inner, "decoder") and hasattr(inner, "module"):
            inner = inner.module
        layers = getattr(getattr(inner, "decoder", None), "layers", None)
        for layer in layers or ():
            mlp = getattr(layer, "mlp", None)
            for submodule_name, names in _ROUTER_PARAMETERS:
                submodule = getattr(mlp, submodule_name, None)
                for name in names:
                    param = getattr(submodule, name, None)
                    if isinstance(param, torch.Tensor):
                        param.requires_grad = False
    return chunks
