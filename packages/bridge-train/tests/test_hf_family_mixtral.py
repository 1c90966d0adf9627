"""The ``mixtral`` family: preset, refusals, and parity with ``transformers`` (tiny random
model with a sliding window shorter than the batch, fp32, CPU).

One 2-rank group: logits at EP=2, TP=2 and TP=1 equal transformers' within 1e-5 relative
on a left-padded batch; the EP=2 model saved with ``save_hf_pretrained`` is bit-identical to
the source and loads in transformers.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from bridge.train.convert import provider_from_hf_config  # noqa: E402

CONFIG: dict[str, Any] = {
    "model_type": "mixtral",
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 5,
    "vocab_size": 300,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def test_preset() -> None:
    p = provider_from_hf_config(CONFIG)
    assert (p.num_moe_experts, p.moe_router_topk, p.moe_ffn_hidden_size) == (4, 2, 32)
    assert p.moe_layer_freq == 1 and not p.moe_router_pre_softmax
    assert p.window_size == (4, 0) and not p.qk_layernorm


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
    ],
)
def test_refusals_name_the_field(changes: dict[str, Any], needle: str, family_parity: Any) -> None:
    message = family_parity.refusal({**CONFIG, **changes})
    assert needle in message, message


def _model(randomized: Any) -> Any:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(**{k: v for k, v in CONFIG.items() if k != "model_type"})
    return randomized(transformers.MixtralForCausalLM(config))


# The shared parity tests (conftest.py).
PARITY = {"model": _model, "layouts": [{"ep": 2}, {"tp": 2}, {"tp": 1}]}
