"""Value head, MoE router freezing and the shared-parameter predicate."""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch

from bridge.train import (
    LinearForLastLayer,
    create_value_head_hook,
    freeze_moe_router,
    make_value_model,
    param_is_not_shared,
)
from bridge.train.testing import tiny_dist_config, tiny_gpt_provider
from core_utils.testing import run_distributed


def test_linear_for_last_layer_accepts_megatron_output_layer_arguments() -> None:
    head = LinearForLastLayer(8, 3, sequence_parallel=False)
    hidden = torch.randn(5, 2, 8)
    out, bias = head(hidden, weight=torch.randn(100, 8), runtime_gather_output=True)
    assert bias is None and out.shape == (5, 2, 3) and out.dtype == torch.float32
    assert head.bias is None
    assert torch.allclose(out, hidden @ head.weight.T)
    assert getattr(
        LinearForLastLayer(8, 1, sequence_parallel=True).weight, "sequence_parallel", False
    )


def test_param_is_not_shared() -> None:
    p = torch.nn.Parameter(torch.zeros(1))
    assert param_is_not_shared(p)
    p.shared = False  # type: ignore[attr-defined]  # megatron's mark, undeclared in torch
    assert param_is_not_shared(p)
    p.shared = True  # type: ignore[attr-defined]
    assert not param_is_not_shared(p)


def test_value_head_hook_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match=r"output_size=0"):
        create_value_head_hook(16, False, output_size=0)


def _hooks_and_freezing(rank: int, world: int) -> dict:
    from bridge.train.engine import MegatronEngine

    provider = tiny_gpt_provider()
    engine = MegatronEngine()
    engine.initialize_distributed(provider, tiny_dist_config())
    # the hook runs before DDP wrapping, so the head gets a gradient buffer
    model = engine.setup_model(
        provider, pre_wrap_hooks=[make_value_model(provider.hidden_size, False)]
    )
    chunk: Any = model[0].module  # megatron's GPTModel, untyped here (megatron is not checked)
    s = provider.seq_length
    tokens = torch.randint(0, 128, (2, s))
    values = model[0](tokens, torch.arange(s).expand(2, s), None)
    values.sum().backward()
    head = chunk.output_layer
    out = {
        "head": type(head).__name__,
        "values_shape": tuple(values.shape),
        "head_grad": float(head.weight.main_grad.abs().sum()),
    }
    two = create_value_head_hook(provider.hidden_size, False, output_size=2)(provider.provide())
    assert two is not None  # the hook returns the chunks it changed
    out["two_outputs"] = cast(LinearForLastLayer, two[0].output_layer).weight.shape[0]

    # MoE model (built, not run: megatron's router needs CUDA at forward time)
    moe = tiny_gpt_provider(
        num_moe_experts=4,
        moe_layer_freq=[1, 0],
        moe_shared_expert_intermediate_size=32,
        moe_shared_expert_gate=True,
        add_bias_linear=False,
    )
    moe_model = moe.provide()
    chunks = freeze_moe_router(moe_model)
    out["moe_chunks"] = len(chunks)
    out["frozen"] = sorted(n for n, p in moe_model.named_parameters() if not p.requires_grad)
    out["trainable_experts"] = any(
        "experts" in n and p.requires_grad for n, p in moe_model.named_parameters()
    )
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_value_head_hook_and_moe_router_freezing() -> None:
    (out,) = run_distributed(_hooks_and_freezing, 1, timeout=180)
    assert out["head"] == "LinearForLastLayer"
    assert out["values_shape"][-1] == 1 and out["head_grad"] > 0
    assert out["two_outputs"] == 2
    assert out["moe_chunks"] == 1
    assert "decoder.layers.0.mlp.router.weight" in out["frozen"]
    assert "decoder.layers.0.mlp.shared_experts.gate_weight" in out["frozen"]
    assert all("router" in n or "gate" in n for n in out["frozen"])
    assert out["trainable_experts"]


def _value_heads_under_virtual_pipeline(rank: int, world: int) -> list[str]:
    from bridge.train.engine import MegatronEngine

    provider = tiny_gpt_provider(
        num_layers=4, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2
    )
    engine = MegatronEngine()
    engine.initialize_distributed(provider, tiny_dist_config())
    hook = create_value_head_hook(provider.hidden_size, False, output_size=3)
    model = engine.setup_model(provider, pre_wrap_hooks=[hook])
    return [type(getattr(chunk.module, "output_layer", None)).__name__ for chunk in model]


@pytest.mark.extended
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_value_head_goes_to_the_last_pipeline_stage_only() -> None:
    # PP=2 with two virtual stages each: only rank 1's second chunk runs the last stage.
    heads = run_distributed(_value_heads_under_virtual_pipeline, 2, timeout=360)
    assert heads == [["NoneType", "NoneType"], ["NoneType", "LinearForLastLayer"]]
