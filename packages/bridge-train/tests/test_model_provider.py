"""GPTModelProvider: validation, vocabulary padding, layer-spec choice, YAML round trip, build."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from bridge.config import ConfigContainer
from bridge.train import GPTModelProvider
from bridge.train.models import (
    MambaProvider,
    T5ModelProvider,
    calculate_padded_vocab_size,
    layer_specs,
    resolve_layer_spec_backend,
)
from bridge.train.models.architecture import same_setting, show_setting
from bridge.train.models.gemma3_provider import Gemma3ModelProvider
from bridge.train.models.gpt_oss_provider import GptOssModelProvider
from bridge.train.models.mla_provider import MLAModelProvider
from bridge.train.testing import tiny_gpt_provider
from core_utils.portable_attention import SDPACoreAttention
from core_utils.testing import run_distributed


def test_provider_is_a_transformer_config_with_tiny_defaults() -> None:
    provider = GPTModelProvider()
    assert isinstance(provider, TransformerConfig)
    assert (provider.num_layers, provider.hidden_size, provider.num_attention_heads) == (2, 64, 4)
    assert provider.seq_length == 64
    assert provider.ffn_hidden_size == 256 and provider.kv_channels == 16
    # Init methods are partials of an importable function, not lambdas.
    assert isinstance(provider.init_method, functools.partial)
    assert provider.init_method.func is torch.nn.init.normal_


@pytest.mark.parametrize(
    ("vocab", "divisible", "tp", "expected"),
    [
        (100, 128, 1, 128),
        (256, 128, 1, 256),
        (257, 128, 1, 384),
        (300, 64, 2, 384),
        (128, 64, 2, 128),
    ],
)
def test_padded_vocab_size_is_divisible_by_granularity_times_tp(
    vocab, divisible, tp, expected
) -> None:
    assert calculate_padded_vocab_size(vocab, divisible, tp) == expected
    provider = tiny_gpt_provider(
        vocab_size=vocab, make_vocab_size_divisible_by=divisible, tensor_model_parallel_size=tp
    )
    assert provider.padded_vocab_size == expected
    assert provider.padded_vocab_size % (divisible * tp) == 0


def test_unpadded_vocab_when_padding_is_off() -> None:
    assert tiny_gpt_provider(vocab_size=100, should_pad_vocab=False).padded_vocab_size == 100
    with pytest.raises(ValueError, match=r"vocab_size=101 is not divisible .* should_pad_vocab"):
        tiny_gpt_provider(vocab_size=101, should_pad_vocab=False, tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match=r"'yarn' needs megatron's yarn_\* fields"):
        tiny_gpt_provider(position_embedding_type="yarn")


def test_tensor_parallel_size_that_does_not_divide_heads_is_refused_with_the_fields() -> None:
    with pytest.raises(ValueError) as info:
        tiny_gpt_provider(num_attention_heads=6, hidden_size=48, tensor_model_parallel_size=4)
    message = str(info.value)
    assert "tensor_model_parallel_size=4" in message and "num_attention_heads=6" in message
    assert "[1, 2, 3, 6]" in message


def test_query_groups_must_fit_the_tensor_parallel_size() -> None:
    with pytest.raises(ValueError, match=r"num_query_groups=3"):
        tiny_gpt_provider(
            num_attention_heads=6, hidden_size=48, num_query_groups=3, tensor_model_parallel_size=2
        )


def test_ffn_width_must_divide_by_tensor_parallel_size() -> None:
    with pytest.raises(ValueError, match=r"ffn_hidden_size=33"):
        tiny_gpt_provider(ffn_hidden_size=33, tensor_model_parallel_size=2)


def test_hidden_size_must_divide_into_heads() -> None:
    with pytest.raises(
        ValueError, match=r"hidden_size=30 is not divisible by model.num_attention_heads=4"
    ):
        tiny_gpt_provider(hidden_size=30)


def test_bad_sizes_are_named() -> None:
    with pytest.raises(ValueError, match=r"model.seq_length must be a positive integer"):
        tiny_gpt_provider(seq_length=0)
    with pytest.raises(ValueError, match=r"model.vocab_size"):
        tiny_gpt_provider(vocab_size=-3)
    with pytest.raises(ValueError, match=r"position_embedding_type='alibi'"):
        tiny_gpt_provider(position_embedding_type="alibi")


def test_vocab_size_is_required_to_build() -> None:
    with pytest.raises(ValueError, match=r"model.vocab_size is not set"):
        _ = tiny_gpt_provider(vocab_size=None).padded_vocab_size


def test_finalize_rederives_derived_fields_but_keeps_user_values() -> None:
    provider = tiny_gpt_provider()
    assert {"ffn_hidden_size", "kv_channels", "init_method"} <= provider.derived_fields
    provider.hidden_size = 64
    provider.finalize()
    assert provider.ffn_hidden_size == 256 and provider.kv_channels == 16
    provider.ffn_hidden_size = 100  # set by the user: kept, and no longer "derived"
    assert "ffn_hidden_size" not in provider.derived_fields
    provider.hidden_size = 128
    provider.finalize()
    assert provider.ffn_hidden_size == 100 and provider.kv_channels == 32


def test_pipeline_dtype_is_derived_from_params_dtype_for_pipeline_layouts() -> None:
    assert tiny_gpt_provider().pipeline_dtype is None  # one stage: nothing crosses stages
    provider = tiny_gpt_provider(pipeline_model_parallel_size=2)
    assert provider.pipeline_dtype == torch.float32 and "pipeline_dtype" in provider.derived_fields
    provider.params_dtype = torch.bfloat16
    provider.bf16 = True
    provider.finalize()
    assert provider.pipeline_dtype == torch.bfloat16
    explicit = tiny_gpt_provider(pipeline_model_parallel_size=2, pipeline_dtype=torch.float16)
    assert explicit.pipeline_dtype == torch.float16


def test_layer_spec_backend_resolution() -> None:
    assert resolve_layer_spec_backend("auto", cuda_available=False, te_installed=True) == "portable"
    assert (
        resolve_layer_spec_backend("auto", cuda_available=True, te_installed=True)
        == "transformer_engine"
    )
    assert resolve_layer_spec_backend("auto", cuda_available=True, te_installed=False) == "local"
    assert (
        resolve_layer_spec_backend("portable", cuda_available=False, te_installed=False)
        == "portable"
    )
    with pytest.raises(ValueError, match=r"'local' requires CUDA.*'portable'"):
        resolve_layer_spec_backend("local", cuda_available=False, te_installed=False)
    with pytest.raises(ValueError, match=r"requires CUDA"):
        resolve_layer_spec_backend("transformer_engine", cuda_available=False, te_installed=True)
    with pytest.raises(ValueError, match=r"pip install bridge-train\[te\]"):
        resolve_layer_spec_backend("transformer_engine", cuda_available=True, te_installed=False)
    with pytest.raises(ValueError, match=r"layer_spec_backend='flash'"):
        resolve_layer_spec_backend("flash")


@pytest.mark.parametrize(
    ("cls", "name"),
    [
        (Gemma3ModelProvider, "Gemma 3"),
        (GptOssModelProvider, "gpt-oss"),
        (MLAModelProvider, "multi-latent attention"),
        (T5ModelProvider, "T5 models"),
    ],
)
def test_providers_of_local_modules_refuse_transformer_engine_and_pick_local_on_cuda(
    cls: type[GPTModelProvider], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    provider = cls(q_lora_rank=16, kv_lora_rank=16) if cls is MLAModelProvider else cls()
    provider.layer_spec_backend = "transformer_engine"
    with pytest.raises(ValueError, match=f"not supported for {name} .*use 'local' or 'auto'"):
        provider.resolved_layer_spec_backend()
    provider.layer_spec_backend = "auto"
    assert provider.resolved_layer_spec_backend() == "portable"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(layer_specs, "_transformer_engine_installed", lambda: True)
    assert provider.resolved_layer_spec_backend() == "local"
    assert GPTModelProvider().resolved_layer_spec_backend() == "transformer_engine"


@pytest.mark.parametrize(
    ("cls", "overrides", "match"),
    [
        (
            Gemma3ModelProvider,
            {"context_parallel_size": 2},
            "model.context_parallel_size=2 is not supported by Gemma 3's local RoPE layers; "
            "set it to 1",
        ),
        (Gemma3ModelProvider, {"add_bias_linear": True}, "add_bias_linear=True .*no biases"),
        (MLAModelProvider, {"multi_latent_attention": False}, "multi_latent_attention=False"),
        (MLAModelProvider, {"position_embedding_type": "none"}, "set it to 'rope'"),
        (MLAModelProvider, {"context_parallel_size": 2}, "context_parallel_size=2"),
        (MambaProvider, {"rope_scaling": True}, "rope_scaling=True .*HybridModel"),
        (T5ModelProvider, {"rotary_base": 500}, "rotary_base=500 .*T5Model"),
    ],
)
def test_a_field_a_provider_fixes_is_refused_by_name(
    cls: type[GPTModelProvider], overrides: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        cls(**overrides)


def test_portable_spec_uses_sdpa_attention_and_refuses_what_it_cannot_run() -> None:
    spec = tiny_gpt_provider(layer_spec_backend="portable").layer_spec()
    assert spec.submodules.self_attention.submodules.core_attention is SDPACoreAttention
    with pytest.raises(ValueError, match=r"context_parallel_size=2"):
        tiny_gpt_provider(layer_spec_backend="portable", context_parallel_size=2).layer_spec()


def test_explicit_layer_spec_callable_overrides_the_backend() -> None:
    calls = []

    def spec_fn(provider, vp_stage=None):
        calls.append(vp_stage)
        return tiny_gpt_provider(layer_spec_backend="portable").layer_spec()

    provider = tiny_gpt_provider(transformer_layer_spec=spec_fn)
    provider.layer_spec(vp_stage=3)
    assert calls == [3]
    # A callable without vp_stage is called with the provider alone; a spec is used as given.
    given = tiny_gpt_provider(layer_spec_backend="portable").layer_spec()
    assert tiny_gpt_provider(transformer_layer_spec=lambda p: given).layer_spec(2) is given
    assert tiny_gpt_provider(transformer_layer_spec=given).layer_spec() is given


def test_same_setting_compares_what_the_values_mean() -> None:
    normal = functools.partial(torch.nn.init.normal_, mean=0.0, std=0.02)
    assert same_setting(normal, functools.partial(torch.nn.init.normal_, mean=0.0, std=0.02))
    assert not same_setting(normal, functools.partial(torch.nn.init.normal_, mean=0.0, std=0.01))
    assert same_setting(Path("/data/a"), "/data/a") and not same_setting(Path("/a"), "/b")
    assert same_setting(0.1 * 3, 0.3) and not same_setting(0.3, 0.31)
    assert same_setting([1, (2.0, 3)], (1, [2, 3])) and not same_setting([1], [1, 2])
    assert not same_setting(torch.ones(2), torch.ones(2))  # no boolean equality: not the same


def test_show_setting_names_functions_and_classes() -> None:
    # The resume check's and the HF families' messages name values through it.
    assert show_setting(torch.nn.functional.silu) == "silu"
    assert show_setting(torch.nn.LayerNorm) == "LayerNorm"
    assert show_setting(0.5) == "0.5" and show_setting("RMSNorm") == "'RMSNorm'"
    assert show_setting(None) == "None"
    normal = functools.partial(torch.nn.init.normal_, std=0.02)  # no name of its own: repr
    assert show_setting(normal) == repr(normal)


def test_gpt_oss_refuses_expert_tensor_parallelism_with_biased_experts() -> None:
    with pytest.raises(ValueError, match=r"expert_tensor_parallel_size=2: .* set it to 1"):
        GptOssModelProvider(
            num_moe_experts=2,
            moe_router_topk=2,
            add_bias_linear=True,
            tensor_model_parallel_size=2,
            expert_tensor_parallel_size=2,
        )
    assert GptOssModelProvider(add_bias_linear=True).expert_tensor_parallel_size == 1


def test_provider_survives_the_yaml_round_trip(tmp_path) -> None:
    provider = tiny_gpt_provider(position_embedding_type="rope", gated_linear_unit=True)
    path = tmp_path / "config.yaml"
    ConfigContainer(model=provider).to_yaml(path)
    loaded = ConfigContainer.from_yaml(path).model
    assert type(loaded) is GPTModelProvider
    for f in dataclasses.fields(provider):
        assert repr(getattr(loaded, f.name)) == repr(getattr(provider, f.name)), f.name
    assert loaded.init_method.func is torch.nn.init.normal_


def _build(rank: int, world: int, provider_a: GPTModelProvider, provider_b: GPTModelProvider):
    from bridge.train.engine.initialize import initialize_distributed, seed_from_rng_config
    from bridge.train.testing import tiny_dist_config

    initialize_distributed(provider_a, tiny_dist_config())
    model_a = provider_a.provide()
    seed_from_rng_config(None)  # seed 1234, as initialize_distributed drew
    model_b = provider_b.provide()
    same = all(
        torch.equal(a, b) for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True)
    )
    attention = model_a.decoder.layers[0].self_attention.core_attention
    return (
        same,
        type(attention).__name__,
        model_a.embedding.word_embeddings.weight.shape[0],
        provider_a.use_cpu_initialization,
        provider_a.transformer_impl,
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_provide_builds_a_cpu_model_and_yaml_loaded_config_builds_the_same_one(tmp_path) -> None:
    provider = tiny_gpt_provider(vocab_size=100)
    path = tmp_path / "config.yaml"
    ConfigContainer(model=provider).to_yaml(path)
    loaded = ConfigContainer.from_yaml(path).model
    ((same, attention, vocab, cpu_init, impl),) = run_distributed(
        _build, 1, provider, loaded, timeout=150
    )
    assert same
    assert attention == "SDPACoreAttention"
    assert vocab == 128  # 100 padded to a multiple of 64
    assert cpu_init and impl == "local"


def test_provide_needs_the_parallel_state() -> None:
    # The test process never initialises megatron's parallel state (ranks are forked).
    with pytest.raises(RuntimeError, match=r"initialize_distributed"):
        tiny_gpt_provider().provide()


def test_vocab_size_comes_from_the_tokenizer_when_unset() -> None:
    from bridge.train.data import ByteLevelTokenizer

    provider = tiny_gpt_provider(vocab_size=None).apply_tokenizer(ByteLevelTokenizer())
    assert provider.vocab_size == 258 and provider.padded_vocab_size == 320
    assert tiny_gpt_provider(vocab_size=300).apply_tokenizer(ByteLevelTokenizer()).vocab_size == 300
    with pytest.raises(
        ValueError, match=r"model.vocab_size=128 is smaller than the tokenizer's vocabulary \(258\)"
    ):
        tiny_gpt_provider(vocab_size=128).apply_tokenizer(ByteLevelTokenizer())


@pytest.mark.parametrize(
    "field", ["layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm"]
)
def test_sequence_parallel_torch_norm_refuses_settings_torch_norms_ignore(field: str) -> None:
    from bridge.train.models.layer_specs import SequenceParallelTorchNorm

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, **{field: True})
    with pytest.raises(ValueError, match=f"model.{field}=True is not supported"):
        SequenceParallelTorchNorm(config, 8)
    norm = SequenceParallelTorchNorm(dataclasses.replace(config, **{field: False}), 8)
    assert isinstance(norm, torch.nn.LayerNorm)
