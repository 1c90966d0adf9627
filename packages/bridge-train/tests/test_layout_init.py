"""``rng.layout_independent_init``: which providers it covers and how the setting resolves.

The weights themselves (bit-identical under every layout) are checked with several ranks in
``tests/test_layout_independent_init.py``; here only the resolution rules, in one process.
"""

from __future__ import annotations

import pytest

from bridge.config import ConfigError, RNGConfig
from bridge.train.models.layout_init import (
    LayoutInitError,
    layout_independent_seed,
    supports_layout_independent_init,
)
from bridge.train.models.t5_provider import T5ModelProvider
from bridge.train.testing import tiny_gpt_provider


def _t5() -> T5ModelProvider:
    return T5ModelProvider(
        num_layers=2,
        encoder_num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=24,
        seq_length_dec=12,
        vocab_size=128,
    )


def test_gpt_providers_use_it_by_default_and_false_turns_it_off() -> None:
    gpt = tiny_gpt_provider()
    moe = tiny_gpt_provider(num_moe_experts=4, moe_router_topk=2, add_bias_linear=False)
    assert supports_layout_independent_init(gpt) and supports_layout_independent_init(moe)
    assert layout_independent_seed(RNGConfig(seed=5), gpt) == 5
    assert layout_independent_seed(RNGConfig(seed=5, layout_independent_init=True), moe) == 5
    assert layout_independent_seed(RNGConfig(layout_independent_init=False), gpt) is None
    # Different weights per data-parallel rank need megatron's seeding.
    assert layout_independent_seed(RNGConfig(data_parallel_random_init=True), gpt) is None


def test_uncovered_providers_keep_megatron_seeding_and_true_is_refused() -> None:
    t5 = _t5()
    assert not supports_layout_independent_init(t5)
    assert layout_independent_seed(RNGConfig(), t5) is None
    with pytest.raises(
        LayoutInitError, match=r"rng.layout_independent_init=true: .*T5ModelProvider"
    ):
        layout_independent_seed(RNGConfig(layout_independent_init=True), t5)


def test_data_parallel_random_init_and_true_exclude_each_other() -> None:
    with pytest.raises(ConfigError, match="layout_independent_init"):
        RNGConfig(layout_independent_init=True, data_parallel_random_init=True)
