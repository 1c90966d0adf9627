"""MambaProvider: validation, backend choice, FLOPs, YAML, and the built model's layout."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bridge.config import ConfigContainer
from bridge.train import MambaProvider
from bridge.train.metrics.flops import num_floating_point_operations
from bridge.train.models.mamba_provider import resolve_hybrid_backend
from core_utils.testing import run_distributed


def _tiny(**overrides):
    values: dict[str, Any] = {
        "num_layers": 4,
        "hybrid_override_pattern": "M*M-",
        "hidden_size": 32,
        "seq_length": 16,
        "vocab_size": 128,
        "make_vocab_size_divisible_by": 64,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    }
    values.update(overrides)
    return MambaProvider(**values)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"hybrid_override_pattern": "M*M"}, r"has 3 layers but model.num_layers=4"),
        ({"hybrid_override_pattern": "M*MX"}, r"unknown symbols \['X'\]"),
        ({"hybrid_attention_ratio": 1.5, "hybrid_override_pattern": None}, r"in \[0, 1\]"),
        ({"mamba_num_groups": 3}, r"not divisible by model.mamba_num_groups=3"),
        ({"mamba_head_dim": 48}, r"mamba_head_dim=48 does not divide"),
        ({"tensor_model_parallel_size": 8, "mamba_num_groups": 4}, r"must divide the Mamba"),
        ({"rope_scaling": True}, r"rope_scaling"),
        ({"mamba_num_heads": 3}, r"has 3 heads .*model.mamba_num_groups=2"),
        ({"transformer_layer_spec": object()}, r"takes model.mamba_stack_spec"),
    ],
)
def test_bad_hybrid_fields_are_refused_naming_the_field(overrides, match) -> None:
    with pytest.raises(ValueError, match=match):
        _tiny(**overrides)


def test_pattern_from_ratios_when_no_pattern_is_given() -> None:
    provider = _tiny(hybrid_override_pattern=None, num_layers=4, hybrid_attention_ratio=0.25)
    assert sorted(provider.layer_pattern) == sorted("MMM*")
    assert _tiny(hybrid_override_pattern=None).layer_pattern == "MMMM"


def test_backend_choice_and_refusals() -> None:
    assert resolve_hybrid_backend("auto", cuda_available=False, missing=[]) == "portable"
    assert resolve_hybrid_backend("auto", cuda_available=True, missing=["mamba_ssm"]) == (
        "portable"
    )
    assert resolve_hybrid_backend("auto", cuda_available=True, missing=[]) == ("transformer_engine")
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve_hybrid_backend("transformer_engine", cuda_available=False, missing=[])
    with pytest.raises(ValueError, match="pip install mamba-ssm causal-conv1d"):
        resolve_hybrid_backend(
            "transformer_engine", cuda_available=True, missing=["mamba_ssm", "causal_conv1d"]
        )
    with pytest.raises(ValueError, match="'local' does not exist"):
        resolve_hybrid_backend("local")
    with pytest.raises(ValueError, match="uses \\['E'\\]"):
        _tiny(hybrid_override_pattern="M*ME", layer_spec_backend="portable").layer_spec()


def test_flops_follow_megatron_lm_hybrid_formula() -> None:
    p = _tiny(hidden_size=32, seq_length=16, num_attention_heads=4)
    b, s, h, v = 3, 16, 32, 128
    d_in, heads, groups, state = 64, 4, 2, 16
    mamba = 2 * b * s * h * (2 * d_in + 2 * groups * state + heads)
    mamba += 7 * b * s * d_in * state + 2 * b * s * d_in * h
    attention = 4 * b * s * h * 1 * (h + h * 4 / 4 + s / 2)
    mlp = 4 * 4 * b * s * h * h
    logits = 2 * b * s * h * v
    want = 3 * (2 * mamba + attention + mlp + logits)
    assert num_floating_point_operations(p, b) == pytest.approx(want)
    assert num_floating_point_operations(p, b) != num_floating_point_operations(
        _tiny(hybrid_override_pattern="MMMM"), b
    )


def test_yaml_round_trip_gives_a_mamba_provider(tmp_path) -> None:
    path = tmp_path / "config.yaml"
    ConfigContainer(model=_tiny()).to_yaml(path)
    loaded = ConfigContainer.from_yaml(path).model
    assert type(loaded) is MambaProvider
    assert loaded.layer_pattern == "M*M-" and loaded.mamba_heads == 4


def _build(rank: int, world: int, provider: MambaProvider):
    from bridge.train.engine.initialize import initialize_distributed
    from bridge.train.testing import tiny_dist_config

    initialize_distributed(provider, tiny_dist_config())
    model = provider.provide()
    kinds = [type(layer).__name__ for layer in model.decoder.layers]
    mixer = type(model.decoder.layers[0].mixer).__name__
    # The keys a checkpoint stores (megatron's names, Transformer Engine's norm placement).
    keys = sorted(item.key for item in model.sharded_state_dict().values())
    tokens = torch.arange(32).reshape(2, 16) % 100
    positions = torch.arange(16).expand(2, 16)
    losses = model(tokens, positions, None, labels=tokens)
    losses.mean().backward()
    grads = all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    # mamba_num_heads sets the head count (the width follows it) instead of 2 x hidden_size.
    wide = _tiny(mamba_num_heads=8).provide().decoder.layers[0].mixer
    heads = (wide.A_log.numel(), wide.in_proj.weight.shape[0], wide.out_proj.weight.shape[1])
    return kinds, mixer, keys, tuple(losses.shape), grads, heads


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_builds_megatron_hybrid_model_with_megatron_checkpoint_keys() -> None:
    ((kinds, mixer, keys, shape, grads, heads),) = run_distributed(_build, 1, _tiny(), timeout=200)
    # 8 heads of mamba_head_dim 16: in_proj gives z, x (128 each), B, C (2 groups x 16) and dt.
    assert heads == (8, 2 * 128 + 2 * 32 + 8, 128)
    assert kinds == ["MambaLayer", "TransformerLayer", "MambaLayer", "MLPLayer"]
    assert mixer == "PortableMambaMixer"
    prefix = "decoder.layers.0.mixer."
    for key in (
        "in_proj.weight",
        "in_proj.layer_norm_weight",
        "conv1d.weight",
        "conv1d.bias",
        "A_log",
        "dt_bias",
        "D",
        "norm.weight",
        "out_proj.weight",
    ):
        assert prefix + key in keys, key
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in keys
    assert "decoder.layers.3.mlp.linear_fc1.layer_norm_weight" in keys
    assert "decoder.final_norm.weight" in keys
    assert shape == (2, 16) and grads


def _rope_step(rank: int, world: int, provider: MambaProvider) -> tuple[float, bool]:
    from bridge.train.engine.initialize import initialize_distributed
    from bridge.train.testing import tiny_dist_config

    initialize_distributed(provider, tiny_dist_config())
    model = provider.provide()
    tokens = torch.arange(32).reshape(2, 16) % 100
    loss = model(tokens, torch.arange(16).expand(2, 16), None, labels=tokens).mean()
    loss.backward()
    grads = all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    return float(loss), grads


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_hybrid_model_with_rope_takes_a_finite_step_without_cuda() -> None:
    # megatron's RotaryEmbedding moves its frequencies to the current CUDA device on the
    # first forward; the provider keeps them on the CPU when there is no GPU.
    ((loss, grads),) = run_distributed(
        _rope_step, 1, _tiny(position_embedding_type="rope"), timeout=200
    )
    assert torch.isfinite(torch.tensor(loss)) and grads


def _megatron_seeded(rank: int, world: int, tp: int) -> dict[str, Any]:
    """The hybrid model built by the engine at TP=``tp`` with megatron's own seeding
    (``rng.layout_independent_init=false``): the first mixer's per-head tensors on this rank
    and the per-token losses of one batch."""
    from bridge.train.engine import MegatronEngine
    from bridge.train.engine.initialize import destroy_distributed
    from bridge.train.testing import tiny_dist_config, tiny_rng_config

    provider = _tiny(tensor_model_parallel_size=tp)
    engine = MegatronEngine()
    engine.initialize_distributed(
        provider, tiny_dist_config(), tiny_rng_config(layout_independent_init=False)
    )
    try:
        model: Any = engine.setup_model(provider, wrap_with_ddp=False)[0]
        mixer = model.decoder.layers[0].mixer
        heads = {n: getattr(mixer, n).detach().clone() for n in ("A_log", "D", "dt_bias")}
        tokens = torch.arange(32).reshape(2, 16) % 100
        with torch.no_grad():
            losses = model(tokens, torch.arange(16).expand(2, 16), None, labels=tokens)
        return {"heads": heads, "losses": losses.clone()}
    finally:
        destroy_distributed()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_portable_mixer_draws_the_same_model_at_tp2_without_layout_independent_init() -> None:
    """docs/providers.md: the mixer draws full tensors and keeps this rank's part, so TP=2
    starts from TP=1's model also with megatron's per-rank seeding."""
    (one,) = run_distributed(_megatron_seeded, 1, 1, timeout=200)
    two = run_distributed(_megatron_seeded, 2, 2, timeout=200)
    for name, full in one["heads"].items():
        parts = [rank["heads"][name] for rank in two]
        assert parts[0].numel() == full.numel() // 2, name  # split over the heads
        assert torch.equal(torch.cat(parts), full), name
    for rank in two:
        assert torch.allclose(rank["losses"], one["losses"], atol=1e-5, rtol=0)
