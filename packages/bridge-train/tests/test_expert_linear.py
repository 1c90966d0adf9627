"""Biased local experts take a training step (``ExpertRowParallelLinear``).

megatron-core 0.19.2's expert MLP adds its output bias in place to what the experts'
``RowParallelLinear`` returned, which autograd refuses at expert TP=1; the layer spec
swaps in :class:`~bridge.train.models.expert_linear.ExpertRowParallelLinear` when the model
has biases. In one forked process: the MoE layer spec of a biased model uses it (and an
unbiased one keeps megatron's), a forward/backward gives every expert bias a gradient, and
megatron's own class still fails that backward (so the workaround can go when megatron
fixes it).
"""

from __future__ import annotations

from typing import Any

import pytest

from bridge.train.testing import tiny_gpt_provider
from core_utils.testing import run_distributed


def _step(rank: int, world: int) -> dict[str, Any]:
    import torch
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    from bridge.train.engine import build_engine
    from bridge.train.models.expert_linear import ExpertRowParallelLinear
    from bridge.train.testing import tiny_dist_config

    def provider(bias: bool) -> Any:
        return tiny_gpt_provider(
            num_moe_experts=2, moe_router_topk=2, add_bias_linear=bias, bias_activation_fusion=False
        )

    biased = provider(True)
    # megatron's MoE layers ask for the CUDA device: set up as the engine does (its CUDA
    # emulation on CPU)
    build_engine().initialize_distributed(biased, tiny_dist_config())
    out: dict[str, Any] = {}
    for name, model_provider in (("biased", biased), ("plain", provider(False))):
        layer = model_provider.layer_spec().layer_specs[0]
        experts = layer.submodules.mlp.keywords["submodules"].experts
        out[name] = experts.keywords["submodules"].linear_fc2.__name__

    def backward(model: torch.nn.Module) -> None:
        tokens = torch.randint(0, 100, (2, biased.seq_length))
        positions = torch.arange(biased.seq_length).expand(2, -1)
        model(tokens, positions, None, labels=tokens).float().sum().backward()

    torch.manual_seed(0)
    model = biased.provide()
    backward(model)
    grads = {
        name: param.grad
        for name, param in model.named_parameters()
        if "local_experts" in name and name.endswith("linear_fc2.bias")
    }
    out["expert_fc2_bias_grads"] = {
        n: g is not None and bool(g.abs().sum() > 0) for n, g in grads.items()
    }
    for module in model.modules():  # megatron's own class: the in-place bias add fails
        if isinstance(module, ExpertRowParallelLinear):
            module.__class__ = RowParallelLinear
    try:
        backward(model)
        out["megatron"] = "ok"
    except RuntimeError as exc:
        out["megatron"] = str(exc)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_biased_experts_train_with_the_expert_linear() -> None:
    (out,) = run_distributed(_step, 1, timeout=240)
    assert out["biased"] == "ExpertRowParallelLinear" and out["plain"] == "RowParallelLinear"
    assert len(out["expert_fc2_bias_grads"]) == 2 * 2, out  # two layers of two experts
    assert all(out["expert_fc2_bias_grads"].values()), out
    assert "is a view and is being modified inplace" in out["megatron"], out["megatron"]
