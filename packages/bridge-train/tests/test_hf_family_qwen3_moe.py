"""The ``qwen3_moe`` family: preset, refusals, and parity with ``transformers`` (tiny random
model with a dense layer among the expert layers, fp32, CPU).

One 2-rank group: logits at EP=2, TP=2 and TP=1 equal transformers' within 1e-5 relative
on a left-padded batch (megatron-core's MoE layer routes the same tokens to the same
experts); the EP=2 model saved with ``save_hf_pretrained`` is bit-identical to the source and
loads in transformers. Extended tier: EP=2 x TP=2 on four ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from bridge.train.convert import ConversionError, provider_from_hf_config  # noqa: E402

CONFIG: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "mlp_only_layers": [1],
    "vocab_size": 300,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def test_preset() -> None:
    p = provider_from_hf_config(CONFIG, expert_model_parallel_size=2)
    assert (p.num_moe_experts, p.moe_router_topk, p.moe_ffn_hidden_size) == (4, 2, 32)
    assert p.moe_layer_freq == [1, 0, 1] and p.ffn_hidden_size == 96
    assert p.moe_router_score_function == "softmax" and not p.moe_router_pre_softmax
    assert p.qk_layernorm and p.expert_model_parallel_size == 2
    assert provider_from_hf_config({**CONFIG, "norm_topk_prob": False}).moe_router_pre_softmax
    sparse = provider_from_hf_config({**CONFIG, "mlp_only_layers": [], "decoder_sparse_step": 1})
    assert sparse.moe_layer_freq == 1


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"num_experts": 0}, "num_experts=0"),
        ({"use_sliding_window": True}, "use_sliding_window=True"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
    ],
)
def test_refusals_name_the_field(changes: dict[str, Any], needle: str, family_parity: Any) -> None:
    message = family_parity.refusal({**CONFIG, **changes})
    assert needle in message, message


def test_expert_parallel_size_must_divide_the_experts() -> None:
    with pytest.raises(ConversionError, match="expert_model_parallel_size=3"):
        provider_from_hf_config(CONFIG, expert_model_parallel_size=3)


def _model(randomized: Any, **changes: Any) -> Any:
    torch.manual_seed(0)
    settings = {**{k: v for k, v in CONFIG.items() if k != "model_type"}, **changes}
    return randomized(transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**settings)))


# The shared parity tests (conftest.py).
PARITY = {"model": _model, "layouts": [{"ep": 2}, {"tp": 2}, {"tp": 1}]}


@pytest.mark.extended
@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
def test_expert_and_tensor_parallel_on_four_ranks(
    tmp_path: Any, family_parity: Any, randomized: Any
) -> None:
    checks = family_parity(tmp_path)
    model = _model(randomized, num_hidden_layers=4)  # two layers per pipeline stage
    result = checks.run(model, [{"ep": 2, "tp": 2}, {"ep": 2, "pp": 2}], world=4)
    for layout in ("ep2,tp2", "ep2,pp2"):
        error = checks.relative_error(result["layouts"][layout], result["reference"])
        assert error <= 1e-5, (layout, error)
    source, saved = checks.tensors(result["hf"]), checks.tensors(result["export"])
    assert all(torch.equal(saved[name], tensor) for name, tensor in source.items())
