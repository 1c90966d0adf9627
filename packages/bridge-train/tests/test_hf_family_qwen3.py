"""The ``qwen3`` family: preset, refusals, and parity with ``transformers`` (tiny random
model, fp32, CPU).

One 2-rank group: logits at TP=2, TP=1 and PP=2 (megatron-core's forward-only pipeline
schedule) equal transformers' within 1e-5 relative on a left-padded batch; the TP=2 model
saved with ``save_hf_pretrained`` is bit-identical to the source and loads in transformers.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from bridge.train.convert import provider_from_hf_config  # noqa: E402

CONFIG: dict[str, Any] = {
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "vocab_size": 300,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}


def test_preset() -> None:
    p = provider_from_hf_config(CONFIG)
    assert p.qk_layernorm and p.normalization == "RMSNorm" and p.gated_linear_unit
    assert (p.kv_channels, p.num_query_groups, p.rotary_base) == (24, 2, 1000000)
    assert not p.add_qkv_bias and not p.add_bias_linear


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"attention_bias": True}, "attention_bias=True is not supported"),
        ({"use_sliding_window": True}, "use_sliding_window=True"),
        (
            {"layer_types": ["sliding_attention", "full_attention"]},
            "layer_types=['full_attention', 'sliding_attention']",
        ),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "'yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
)
def test_refusals_name_the_field(changes: dict[str, Any], needle: str, family_parity: Any) -> None:
    message = family_parity.refusal({**CONFIG, **changes})
    assert needle in message, message


def _model(randomized: Any) -> Any:
    torch.manual_seed(0)
    config = transformers.Qwen3Config(**{k: v for k, v in CONFIG.items() if k != "model_type"})
    return randomized(transformers.Qwen3ForCausalLM(config))


# The shared parity tests (conftest.py).
PARITY = {"model": _model, "layouts": [{"tp": 2}, {"tp": 1}, {"pp": 2}]}
