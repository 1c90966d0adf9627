"""``rng.layout_independent_init``: which providers it covers and how the setting resolves.

The weights themselves (bit-identical under every layout) are checked with several ranks in
``tests/test_layout_independent_init.py``; here only the resolution rules, in one process.
"""

from __future__ import annotations

from typing import Any

import pytest

from bridge.config import ConfigError, RNGConfig
from bridge.train.models.layout_init import (
    LayoutInitError,
    layout_independent_seed,
    supports_layout_independent_init,
)
from bridge.train.models.t5_provider import T5ModelProvider
from bridge.train.testing import tiny_gpt_provider

_SMALL: dict[str, Any] = {
    "encoder_num_layers": 1,
    "num_attention_heads": 4,
    "seq_length": 24,
    "seq_length_dec": 12,
    "vocab_size": 128,
}


def _t5() -> T5ModelProvider:
    return T5ModelProvider(num_layers=2, hidden_size=32, **_SMALL)


def test_gpt_providers_use_it_by_default_and_false_turns_it_off() -> None:
    gpt = tiny_gpt_provider()
    moe = tiny_gpt_provider(num_moe_experts=4, moe_router_topk=2, add_bias_linear=False)
    assert supports_layout_independent_init(gpt) and supports_layout_independent_init(moe)
    assert layout_independent_seed(RNGConfig(seed=5), gpt) == 5
    assert layout_independent_seed(RNGConfig(seed=5, layout_independent_init=True), moe) == 5
    assert layout_independent_seed(RNGConfig(layout_independent_init=False), gpt) is None
    # Different weights per data-parallel rank need megatron's seeding.
    assert layout_independent_seed(RNGConfig(data_parallel_random_init=True), gpt) is None


def test_every_provider_of_this_package_uses_it_by_default() -> None:
    from bridge.train.models import MambaProvider
    from bridge.train.models.gemma3_provider import Gemma3ModelProvider
    from bridge.train.models.gpt_oss_provider import GptOssModelProvider
    from bridge.train.models.mla_provider import MLAModelProvider

    for provider_class in (
        T5ModelProvider,
        MambaProvider,
        Gemma3ModelProvider,
        MLAModelProvider,
        GptOssModelProvider,
    ):
        provider = provider_class.__new__(provider_class)  # no fields needed to decide
        assert supports_layout_independent_init(provider), provider_class.__name__
    assert layout_independent_seed(RNGConfig(seed=3), _t5()) == 3


class _OwnBuild(T5ModelProvider):
    """A user's provider that builds its own modules (not known to the initialisation)."""

    def provide(
        self,
        pre_process: bool | None = None,
        post_process: bool | None = None,
        vp_stage: int | None = None,
    ) -> Any:
        return super().provide(pre_process, post_process, vp_stage)


def test_a_provider_with_its_own_provide_keeps_megatron_seeding_and_true_is_refused() -> None:
    own = _OwnBuild(num_layers=2, hidden_size=32, **_SMALL)
    assert not supports_layout_independent_init(own)
    assert layout_independent_seed(RNGConfig(), own) is None
    with pytest.raises(LayoutInitError, match=r"rng.layout_independent_init=true: .*_OwnBuild"):
        layout_independent_seed(RNGConfig(layout_independent_init=True), own)


def test_data_parallel_random_init_and_true_exclude_each_other() -> None:
    with pytest.raises(ConfigError, match="layout_independent_init"):
        RNGConfig(layout_independent_init=True, data_parallel_random_init=True)
