"""Mixture-of-experts helpers for model chunks."""

from __future__ import annotations

import torch

from bridge.train.engine._distributed_utils import unwrap_model_chunks

__all__ = ["freeze_moe_router"]

# The frozen parameters, by how their names end: a MoE layer's router and its shared experts'
# gate (megatron names them so in every layer's mlp, a wrapper's "module." prefix before).
_ROUTER_PARAMETERS = (
    ".mlp.router.weight",
    ".mlp.router.bias",
    ".mlp.shared_experts.gate_weight",
    ".mlp.shared_experts.gate_bias",
)


def freeze_moe_router(model: list[torch.nn.Module] | torch.nn.Module) -> list[torch.nn.Module]:
    """Freeze MoE router and shared-expert gate parameters in model chunks.

    In every layer whose ``mlp`` is a MoE layer, ``mlp.router.weight``/``bias`` and
    ``mlp.shared_experts.gate_weight``/``gate_bias`` (where present) get
    ``requires_grad=False``. Call it before the model is wrapped for data parallelism and
    before the optimizer is built, so frozen parameters get no gradient buffer and no
    optimizer state. Wrapped chunks (``.module``) are searched through their wrapper.

    Args:
        model: Single megatron module or list of virtual-pipeline model chunks.

    Returns:
        The normalized model chunk list with router parameters frozen in place.
    """
    chunks = unwrap_model_chunks(model)
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if name.endswith(_ROUTER_PARAMETERS):
                param.requires_grad = False
    return chunks
