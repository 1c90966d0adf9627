"""The ``gpt_oss`` family: preset, refusals, and parity with ``transformers`` (tiny random
model, fp32, CPU).

The model exercises every feature the family maps: attention sinks (random per-head
logits), a sliding-window layer (a window shorter than the batch) and a full-attention one,
YaRN RoPE whose correction range falls inside the head (unrounded: ``truncate: false``),
biases everywhere, a biased router, and expert weights large enough that the SwiGLU clamp
cuts some gate and up values; a check on transformers alone shows each of these changes the
logits. One 2-rank group: logits at EP=2, TP=2 and TP=1 equal transformers' within 1e-5
relative on a left-padded batch; the EP=2 model saved with ``save_hf_pretrained`` is
bit-identical to the source (the experts' stacked tensors written slice by slice) and loads
in transformers, and ``bridge-convert`` import (for EP=2) then export is bit-identical too.
Extended tier: EP=2 x TP=2 on four ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from bridge.train.convert import provider_from_hf_config  # noqa: E402

YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
}
CONFIG: dict[str, Any] = {
    "model_type": "gpt_oss",
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 4,
    "layer_types": ["sliding_attention", "full_attention"],
    "max_position_embeddings": 16384,
    "tie_word_embeddings": False,
    "rope_parameters": YARN,
    "router_aux_loss_coef": 0.01,
}


def test_preset() -> None:
    p = provider_from_hf_config(CONFIG, expert_model_parallel_size=2)
    assert type(p).__name__ == "GptOssModelProvider"
    assert (p.num_query_groups, p.kv_channels) == (2, 16)
    assert p.add_bias_linear and p.softmax_type == "learnable"
    assert p.activation_func.__name__ == "quick_gelu" and p.gated_linear_unit
    assert (p.activation_func_clamp_value, p.glu_linear_offset) == (7.0, 1.0)
    assert p.window_size == (3, 0) and p.window_attn_skip_freq == [1, 0]
    assert (p.position_embedding_type, p.rotary_base) == ("yarn", 150000)
    assert (p.yarn_rotary_scaling_factor, p.yarn_original_max_position_embeddings) == (4.0, 4096)
    assert not p.yarn_correction_range_round_to_int
    assert p.yarn_mscale is None and p.yarn_mscale_all_dim is None
    assert (p.num_moe_experts, p.moe_router_topk, p.moe_ffn_hidden_size) == (4, 2, 32)
    assert p.moe_layer_freq == 1 and not p.moe_router_pre_softmax
    assert p.moe_router_score_function == "softmax" and p.moe_aux_loss_coeff == 0.01
    assert p.expert_tensor_parallel_size == 1 and p.expert_model_parallel_size == 2
    plain = provider_from_hf_config({**CONFIG, "rope_parameters": {"rope_type": "default"}})
    assert plain.position_embedding_type == "rope" and plain.rotary_base == 150000
    assert plain.yarn_rotary_scaling_factor == 1.0


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"quantization_config": {"quant_method": "mxfp4"}}, "quant_method='mxfp4'"),
        ({"attention_bias": False}, "attention_bias=False"),
        ({"swiglu_alpha": 1.5}, "swiglu_alpha=1.5"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "'linear'"),
        ({"rope_parameters": {**YARN, "attention_factor": 2.0}}, "attention_factor=2.0"),
        ({"rope_parameters": {**YARN, "rope_theta": 150000.5}}, "rope_theta=150000.5"),
        ({"rope_parameters": {**YARN, "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
        ({"layer_types": ["chunked_attention", "full_attention"]}, "chunked_attention"),
    ],
)
def test_refusals_name_the_field(changes: dict[str, Any], needle: str, family_parity: Any) -> None:
    message = family_parity.refusal({**CONFIG, **changes})
    assert needle in message, message


def test_a_yarn_factor_without_yarn_is_refused() -> None:
    provider = provider_from_hf_config({**CONFIG, "rope_parameters": {"rope_type": "default"}})
    provider.yarn_rotary_scaling_factor = 4.0
    with pytest.raises(ValueError, match=r"yarn_rotary_scaling_factor=4\.0"):
        provider.finalize()


def _model(randomized: Any, **changes: Any) -> Any:
    torch.manual_seed(0)
    fields = {k: v for k, v in {**CONFIG, **changes}.items() if k != "model_type"}
    model = randomized(transformers.GptOssForCausalLM(transformers.GptOssConfig(**fields)))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.copy_(torch.randn(param.shape, generator=generator))
            elif name.endswith("router.weight"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                # Large enough that the clamp at swiglu_limit cuts some values.
                param.copy_(torch.randn(param.shape, generator=generator) * 0.6)
    return model


def test_the_test_model_exercises_every_feature(randomized: Any, family_parity: Any) -> None:
    """Each mapped feature changes transformers' logits on the test batch, so the parity
    checks below would see it computed wrongly."""
    reference = family_parity.hf_logits(_model(randomized))
    variants: dict[str, Any] = {
        "clamp": {"swiglu_limit": 1e4},
        "sliding window": {"layer_types": ["full_attention", "full_attention"]},
        "yarn": {"rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}},
        "truncate": {"rope_parameters": {**YARN, "truncate": True}},
    }
    for feature, changes in variants.items():
        logits = family_parity.hf_logits(_model(randomized, **changes))
        assert not torch.allclose(logits, reference, rtol=1e-3, atol=0), feature
    sinkless = _model(randomized)
    with torch.no_grad():
        for name, param in sinkless.named_parameters():
            if name.endswith("sinks"):
                param.fill_(-1e4)  # exp(sink) = 0: plain softmax
    assert not torch.allclose(family_parity.hf_logits(sinkless), reference, rtol=1e-3, atol=0)


# The shared parity tests (conftest.py); extended tier: EP=2 x TP=2 on four ranks.
PARITY = {
    "model": _model,
    "layouts": [{"ep": 2}, {"tp": 2}, {"tp": 1}],
    "convert": ["--ep", "2"],
    "four_ranks": [{"ep": 2, "tp": 2}],
}
