"""GPT-provider presets from Hugging Face ``config.json`` dicts (no model is built)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bridge.train.convert import ConversionError, provider_from_hf_config

LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def _llama(**changes: Any) -> dict[str, Any]:
    return {**LLAMA, **changes}


def test_llama_preset_fields() -> None:
    p = provider_from_hf_config(_llama(rope_theta=500000.0))
    assert (p.normalization, p.layernorm_epsilon, p.gated_linear_unit) == ("RMSNorm", 1e-5, True)
    assert p.activation_func is torch.nn.functional.silu
    assert (p.num_query_groups, p.kv_channels, p.ffn_hidden_size) == (2, 16, 96)
    assert (p.position_embedding_type, p.rotary_base, p.seq_length) == ("rope", 500000, 4096)
    assert not p.add_bias_linear and not p.add_qkv_bias
    assert not p.share_embeddings_and_output_weights


@pytest.mark.parametrize(
    "spelling",
    [
        {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 32.0}},
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0}},
    ],
)
def test_llama3_rope_scaling_both_spellings(spelling: dict[str, Any]) -> None:
    p = provider_from_hf_config(_llama(**spelling))
    assert (p.rope_scaling, p.rope_scaling_factor, p.rotary_base) == (True, 32.0, 500000)


def test_linear_rope_scaling_is_position_interpolation() -> None:
    p = provider_from_hf_config(_llama(rope_scaling={"type": "linear", "factor": 4.0}))
    assert p.seq_len_interpolation_factor == 4.0 and not p.rope_scaling


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0}},
            "low_freq_factor",
        ),
        ({"attention_bias": True}, "attention_bias=True is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"model_type": "bert"}, "model_type='bert' is not supported"),
        ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
        ({"rope_theta": 10000.5}, "integer rotary_base"),
        ({"num_hidden_layers": None}, "has no 'num_hidden_layers'"),
    ],
)
def test_refused_settings_name_the_field(changes: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConversionError, match=r"config\.json") as info:
        provider_from_hf_config(_llama(**changes))
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_llama_biases_everywhere_and_qwen2_qkv_bias() -> None:
    assert provider_from_hf_config(_llama(attention_bias=True, mlp_bias=True)).add_bias_linear
    qwen = provider_from_hf_config(_llama(model_type="qwen2", tie_word_embeddings=True))
    assert qwen.add_qkv_bias and not qwen.add_bias_linear
    assert qwen.share_embeddings_and_output_weights


def test_mistral_sliding_window() -> None:
    assert provider_from_hf_config(
        _llama(model_type="mistral", sliding_window=4096)
    ).window_size == (4095, 0)
    assert (
        provider_from_hf_config(_llama(model_type="mistral", sliding_window=None)).window_size
        is None
    )


def test_gpt2_preset() -> None:
    config = {
        "model_type": "gpt2",
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 128,
        "vocab_size": 300,
        "activation_function": "gelu_new",
    }
    p = provider_from_hf_config(config)
    assert (p.position_embedding_type, p.seq_length, p.normalization) == (
        "learned_absolute",
        128,
        "LayerNorm",
    )
    assert p.add_bias_linear and p.share_embeddings_and_output_weights
    assert p.ffn_hidden_size == 256 and not p.gated_linear_unit
    x = torch.linspace(-3, 3, 13)
    assert torch.equal(p.activation_func(x), torch.nn.functional.gelu(x, approximate="tanh"))
    with pytest.raises(ConversionError, match="n_positions=128"):
        provider_from_hf_config(config, seq_length=256)
    with pytest.raises(ConversionError, match="activation_function='swish'"):
        provider_from_hf_config({**config, "activation_function": "swish"})


def test_parallel_layout_is_validated() -> None:
    with pytest.raises(ConversionError, match="tensor_model_parallel_size=3"):
        provider_from_hf_config(LLAMA, tensor_model_parallel_size=3)
    with pytest.raises(ConversionError, match=r"pipeline_model_parallel_size=3 \(--pp\)"):
        provider_from_hf_config(LLAMA, pipeline_model_parallel_size=3)
    with pytest.raises(ConversionError, match="model_type='llama' has no experts"):
        provider_from_hf_config(LLAMA, expert_model_parallel_size=2)
    p = provider_from_hf_config(
        LLAMA, tensor_model_parallel_size=2, make_vocab_size_divisible_by=64
    )
    assert p.padded_vocab_size == 384  # 300 rounded up to a multiple of 64 x 2


_OPTIONAL = ("num_key_value_heads", "rms_norm_eps", "tie_word_embeddings")
_BARE_LLAMA = {k: v for k, v in LLAMA.items() if k not in _OPTIONAL}
_BARE_GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 32}


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        # Every optional Llama-shaped decoder key absent, then null where transformers reads
        # `config.get(key) or default`.
        (
            _BARE_LLAMA,
            {
                "num_query_groups": 4,
                "kv_channels": 16,
                "layernorm_epsilon": 1e-6,
                "share_embeddings_and_output_weights": False,
                "attention_dropout": 0.0,
            },
        ),
        (
            {**_BARE_LLAMA, "num_key_value_heads": None, "head_dim": 0, "attention_dropout": None},
            {"num_query_groups": 4, "kv_channels": 16, "attention_dropout": 0.0},
        ),
        # A family's own defaults of the shared keys.
        (
            {**_BARE_LLAMA, "model_type": "gemma3_text", "sliding_window": 8},
            {"share_embeddings_and_output_weights": True, "layernorm_epsilon": 1e-6},
        ),
        (
            {
                **_BARE_LLAMA,
                "model_type": "mixtral",
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
            },
            {"moe_router_topk": 2, "moe_aux_loss_coeff": 0.0},
        ),
        (
            {**_BARE_GPT2, "vocab_size": 300, "n_inner": None},
            {
                "ffn_hidden_size": 256,
                "layernorm_epsilon": 1e-5,
                "share_embeddings_and_output_weights": True,
                "hidden_dropout": 0.1,
                "attention_dropout": 0.1,
            },
        ),
    ],
    ids=["llama-absent", "llama-null", "gemma3", "mixtral", "gpt2"],
)
def test_config_field_defaults(config: dict[str, Any], expected: dict[str, Any]) -> None:
    p = provider_from_hf_config(config)
    assert {name: getattr(p, name) for name in expected} == expected


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({k: v for k, v in LLAMA.items() if k != "hidden_size"}, "hidden_size"),
        ({**LLAMA, "vocab_size": None}, "vocab_size"),
        (_BARE_GPT2, "vocab_size"),
        ({**LLAMA, "model_type": "mixtral", "num_local_experts": 4}, "num_experts_per_tok"),
    ],
)
def test_a_required_config_field_is_named(config: dict[str, Any], key: str) -> None:
    with pytest.raises(ConversionError, match=f"has no {key!r}"):
        provider_from_hf_config(config)
