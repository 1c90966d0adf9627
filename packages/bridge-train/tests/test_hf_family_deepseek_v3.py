"""The ``deepseek_v3`` family: preset, refusals, and parity with ``transformers`` (tiny random
model, fp32, CPU).

The model exercises every feature the family maps: multi-latent attention with both
low-rank projections and YaRN RoPE whose ``mscale`` and ``mscale_all_dim`` differ (so the
cos/sin factor and the softmax scale both change), a dense first layer, shared experts,
sigmoid routing with a random expert-bias correction, group-limited top-k (4 groups, 2
kept) and ``routed_scaling_factor``; a check on transformers alone shows each of these
changes the logits. One 2-rank group: logits at EP=2, TP=2 and TP=1 equal transformers'
within 1e-5 relative on a left-padded batch; the EP=2 model saved with
``save_hf_pretrained`` is bit-identical to the source and loads in transformers, and
``bridge-convert`` import (for EP=2) then export is bit-identical too. Tensors of
multi-token-prediction layers are skipped on import. Extended tier: EP=2 x TP=2 on four
ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from bridge.train.convert import ConversionError, provider_from_hf_config  # noqa: E402

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 4,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.9,
    "mscale_all_dim": 0.7,
}
CONFIG: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "max_position_embeddings": 16,
    "tie_word_embeddings": False,
    "rope_parameters": YARN,
}


def test_preset() -> None:
    p = provider_from_hf_config(CONFIG, expert_model_parallel_size=2)
    assert type(p).__name__ == "MLAModelProvider" and p.multi_latent_attention
    assert (p.q_lora_rank, p.kv_lora_rank, p.qk_head_dim, p.qk_pos_emb_head_dim, p.v_head_dim) == (
        24,
        16,
        16,
        8,
        16,
    )
    assert p.qk_layernorm and p.normalization == "RMSNorm" and not p.add_bias_linear
    assert (p.rope_type, p.rotary_base, p.rotary_scaling_factor) == ("yarn", 10000, 4.0)
    assert (p.original_max_position_embeddings, p.mscale, p.mscale_all_dim) == (4, 0.9, 0.7)
    assert (p.num_moe_experts, p.moe_router_topk, p.moe_ffn_hidden_size) == (8, 4, 32)
    assert p.moe_layer_freq == [0, 1, 1] and p.ffn_hidden_size == 96
    assert p.moe_shared_expert_intermediate_size == 32
    assert p.moe_router_score_function == "sigmoid" and p.moe_router_enable_expert_bias
    assert (p.moe_router_num_groups, p.moe_router_group_topk) == (4, 2)
    assert p.moe_router_topk_scaling_factor == 2.5 and p.moe_router_dtype == "fp32"
    assert p.moe_router_load_balancing_type == "seq_aux_loss" and p.moe_aux_loss_coeff == 1e-4
    assert p.expert_model_parallel_size == 2
    plain = provider_from_hf_config({**CONFIG, "rope_parameters": None, "rope_theta": 10000})
    assert plain.rope_type == "rope" and plain.mscale_all_dim == 0.0
    # Every group kept: the limit changes nothing and is left out.
    ungrouped = provider_from_hf_config({**CONFIG, "topk_group": 4})
    assert ungrouped.moe_router_group_topk is None
    original = provider_from_hf_config({**CONFIG, "aux_loss_alpha": 0.001, "seq_aux": False})
    assert original.moe_router_load_balancing_type == "aux_loss"
    assert original.moe_aux_loss_coeff == 0.001


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"q_lora_rank": None}, "q_lora_rank=None"),
        ({"rope_interleave": False}, "rope_interleave=False"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
        ({"rms_norm_eps": 1e-5}, "rms_norm_eps=1e-05"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "'linear'"),
        ({"rope_parameters": {**YARN, "attention_factor": 2.0}}, "attention_factor=2.0"),
        ({"rope_parameters": {**YARN, "mscale": 0.0}}, "rope_parameters.mscale=0.0"),
        ({"rope_parameters": {**YARN, "truncate": False}}, "truncate=False"),
        ({"rope_parameters": {**YARN, "rope_theta": 10000.5}}, "rope_theta=10000.5"),
        ({"norm_topk_prob": False}, "norm_topk_prob=False"),
        (
            {"num_experts_per_tok": 1, "n_group": 1, "topk_group": 1},
            "norm_topk_prob=True",
        ),
        ({"topk_group": 1}, "topk_group=1"),
        ({"n_group": 3}, "n_group=3"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"n_shared_experts": 0}, "n_shared_experts=0"),
        ({"n_routed_experts": 0}, "n_routed_experts=0"),
        ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
        ({"topk_method": "greedy"}, "topk_method='greedy'"),
        ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ],
)
def test_refusals_name_the_field(changes: dict[str, Any], needle: str, family_parity: Any) -> None:
    message = family_parity.refusal({**CONFIG, **changes})
    assert needle in message, message


def test_tensor_parallel_size_must_divide_the_latent_projections() -> None:
    with pytest.raises(ConversionError, match="q_lora_rank=30"):
        provider_from_hf_config(
            {**CONFIG, "q_lora_rank": 30, "num_attention_heads": 4}, tensor_model_parallel_size=4
        )


def _model(randomized: Any, **changes: Any) -> Any:
    torch.manual_seed(0)
    fields = {k: v for k, v in {**CONFIG, **changes}.items() if k != "model_type"}
    model = randomized(transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**fields)))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a buffer: randomized() skips it
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.2)
    return model


def test_the_test_model_exercises_every_feature(randomized: Any, family_parity: Any) -> None:
    """Each mapped feature changes transformers' logits on the test batch, so the parity
    checks below would see it computed wrongly."""
    reference = family_parity.hf_logits(_model(randomized))
    variants: dict[str, Any] = {
        "yarn": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
        "mscale": {"rope_parameters": {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}},
        "group limit": {"topk_group": 4},
        "routed scale": {"routed_scaling_factor": 1.0},
    }
    for feature, changes in variants.items():
        logits = family_parity.hf_logits(_model(randomized, **changes))
        assert not torch.allclose(logits, reference, rtol=1e-3, atol=0), feature
    unbiased = _model(randomized)
    with torch.no_grad():
        for name, buffer in unbiased.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.zero_()
    assert not torch.allclose(family_parity.hf_logits(unbiased), reference, rtol=1e-3, atol=0)


def test_multi_token_prediction_layers_are_skipped(
    tmp_path: Path, randomized: Any, family_parity: Any
) -> None:
    from safetensors.torch import load_file, save_file

    from bridge.train.convert.source import HFSource
    from bridge.train.models.families import family_for

    hf = family_parity(tmp_path).save(_model(randomized))
    tensors = load_file(str(hf / "model.safetensors"))
    mtp = {
        "model.layers.3.eh_proj.weight": torch.zeros(64, 128),
        "model.layers.3.enorm.weight": torch.ones(64),
    }
    save_file({**tensors, **mtp}, str(hf / "model.safetensors"), metadata={"format": "pt"})
    source = HFSource(hf)
    try:
        provider = provider_from_hf_config(source.config)
        mappings = source.mappings(provider.padded_vocab_size)
        assert not {name for m in mappings for name in m.hf} & set(mtp)
        assert source.skipped() == sorted(mtp)
    finally:
        source.close()
    written, _ = family_for("deepseek_v3").export_config(
        {**CONFIG, "num_nextn_predict_layers": 1}, "model."
    )
    assert written["num_nextn_predict_layers"] == 0


# The shared parity tests (conftest.py); extended tier: EP=2 x TP=2 on four ranks.
PARITY = {
    "model": _model,
    "layouts": [{"ep": 2}, {"tp": 2}, {"tp": 1}],
    "convert": ["--ep", "2"],
    "four_ranks": [{"ep": 2, "tp": 2}],
}
