"""The ``gemma3_text`` and ``gemma3`` families: preset, refusals, and parity with
``transformers`` (tiny random models, fp32, CPU).

The text model has sliding-window and full-attention layers interleaved (a window shorter
than the batch), its own RoPE base on the window layers and linear RoPE scaling on the
full ones, and random (non-zero) zero-centred norms. One 2-rank group: logits at TP=2 and
TP=1 equal transformers' within 1e-5 relative on a left-padded batch and the TP=2 model
saved with ``save_hf_pretrained`` is bit-identical to the source; ``bridge-convert`` import
(for TP=2) and export of it are bit-identical too. The multimodal ``gemma3`` model: its text
model imported at TP=2 gives the same logits as the whole model on text, and leaves as a
``Gemma3ForCausalLM`` with the language model's tensors bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from bridge.train.convert import provider_from_hf_config  # noqa: E402

TEXT: dict[str, Any] = {
    "model_type": "gemma3_text",
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "sliding_window": 4,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "query_pre_attn_scalar": 24,
    "max_position_embeddings": 64,
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
}


def test_preset() -> None:
    p = provider_from_hf_config(TEXT)
    assert type(p).__name__ == "Gemma3ModelProvider"
    assert p.window_size == (3, 0) and p.window_attn_skip_freq == [1, 0, 1]
    assert (p.rotary_base, p.rotary_base_local, p.seq_len_interpolation_factor) == (
        1000000,
        10000,
        2.0,
    )
    assert p.softmax_scale == pytest.approx(24**-0.5) and p.qk_layernorm
    assert p.layernorm_zero_centered_gamma and p.share_embeddings_and_output_weights
    assert p.gated_linear_unit and p.activation_func.__name__ == "gelu_tanh"
    legacy = {k: v for k, v in TEXT.items() if k not in ("layer_types", "rope_parameters")}
    old = provider_from_hf_config(
        {**legacy, "num_hidden_layers": 6, "rope_theta": 1e6, "rope_local_base_freq": 1e4}
    )
    assert old.window_attn_skip_freq == [1, 1, 1, 1, 1, 0]  # every sixth layer is global
    multimodal = {"model_type": "gemma3", "text_config": TEXT, "vision_config": {}}
    assert provider_from_hf_config(multimodal).window_attn_skip_freq == [1, 0, 1]


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
        ({"hidden_activation": "silu"}, "hidden_activation='silu'"),
        ({"layer_types": ["chunked_attention"] * 3}, "layer_types=['chunked_attention']"),
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                }
            },
            "rope_parameters.full_attention.rope_type='yarn'",
        ),
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                }
            },
            "rope_parameters.sliding_attention.rope_type='linear'",
        ),
    ],
)
def test_refusals_name_the_field(changes: dict[str, Any], needle: str, family_parity: Any) -> None:
    message = family_parity.refusal({**TEXT, **changes})
    assert needle in message, message


def _text_config() -> Any:
    return transformers.Gemma3TextConfig(**{k: v for k, v in TEXT.items() if k != "model_type"})


def _randomized_norms(model: Any) -> Any:
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # zero-initialised in Gemma: make (1 + weight) count
                param.add_(torch.randn(param.shape, generator=generator) * 0.3)
    return model.float().eval()


def _text_model(randomized: Any) -> Any:
    torch.manual_seed(0)
    return _randomized_norms(transformers.Gemma3ForCausalLM(_text_config()))


# The shared parity tests (conftest.py) of the text model.
PARITY = {"model": _text_model, "layouts": [{"tp": 2}, {"tp": 1}], "convert": ["--tp", "2"]}


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_multimodal_gemma3_text_model(
    tmp_path_factory: pytest.TempPathFactory, family_parity: Any
) -> None:
    torch.manual_seed(0)
    vision = transformers.SiglipVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = transformers.Gemma3Config(
        text_config=_text_config(), vision_config=vision, mm_tokens_per_image=4
    )
    model = _randomized_norms(transformers.Gemma3ForConditionalGeneration(config))
    checks = family_parity(tmp_path_factory.mktemp("gemma3"))
    result = checks.run(model, [{"tp": 2}])
    checks.assert_logits_match(result, "tp2")
    source, saved = checks.tensors(result["hf"]), checks.tensors(result["export"])
    text_prefix = "language_model.model."
    expected = {
        f"model.{name[len(text_prefix) :]}": tensor
        for name, tensor in source.items()
        if name.startswith(text_prefix)
    }
    assert sorted(saved) == sorted(expected)
    assert all(torch.equal(saved[name], tensor) for name, tensor in expected.items())
    exported = transformers.AutoModelForCausalLM.from_pretrained(result["export"]).float().eval()
    assert type(exported).__name__ == "Gemma3ForCausalLM"
    error = checks.relative_error(checks.hf_logits(exported), result["reference"])
    assert error <= 1e-5, error
