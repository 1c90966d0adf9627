"""Layout-independent initialisation: the same seed gives bit-identical global weights.

Two forked ranks build each provider with megatron-core's engine under several layouts, one
after the other in the same process group (start-up dominates): the tiny GPT (dense and
MoE), T5, hybrid Mamba (Mamba mixer, attention and MLP layers), and the Hugging Face
families whose ``provide`` is their own: Gemma 3, DeepSeek-V3 (multi-latent attention,
shared and routed experts) and gpt-oss (attention sinks, biased experts). Each rank reports
its shards (the model's ``sharded_state_dict``: key, global offset, local tensor) and the
shards are put together into global tensors. Every layout (TP=2, PP=2, PP=2 x VPP=2, EP=2;
T5 has no pipeline parallelism) must give the same global tensors, bit for bit, as the
family's layout with one model-parallel rank (DP=2), and (extended tier) that one equals a
one-process build. megatron's per-stage seeding (``rng.layout_independent_init=false``) is
shown to differ under PP=2, so the check can fail. The default tier runs GPT, T5 and hybrid
Mamba; the extended tier every family and layout.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from core_utils.testing import run_distributed

DENSE = {"num_layers": 4}
MOE = {"num_layers": 4, "num_moe_experts": 4, "moe_router_topk": 2, "add_bias_linear": False}
LAYOUTS: dict[str, dict[str, Any]] = {
    "dp2": DENSE,
    "tp2": {**DENSE, "tensor_model_parallel_size": 2},
    "pp2": {**DENSE, "pipeline_model_parallel_size": 2},
    "pp2_vpp2": {
        **DENSE,
        "pipeline_model_parallel_size": 2,
        "virtual_pipeline_model_parallel_size": 2,
        "batch_p2p_comm": False,
    },
    "swiglu_tp2": {**DENSE, "tensor_model_parallel_size": 2, "gated_linear_unit": True},
    "swiglu_dp2": {**DENSE, "gated_linear_unit": True},
    "moe_dp2": MOE,
    "moe_ep2": {**MOE, "expert_model_parallel_size": 2},
    "moe_tp2": {**MOE, "tensor_model_parallel_size": 2},
    "moe_pp2": {**MOE, "pipeline_model_parallel_size": 2},
}


# The providers other than GPT, as tiny models (fp32). Each test's layouts are overrides of
# these fields.
T5: dict[str, Any] = {
    "num_layers": 2,
    "encoder_num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "seq_length": 24,
    "seq_length_dec": 12,
    "vocab_size": 128,
    "make_vocab_size_divisible_by": 64,
}
MAMBA: dict[str, Any] = {
    "num_layers": 4,
    "hybrid_override_pattern": "M*M-",
    "hidden_size": 32,
    "seq_length": 16,
    "vocab_size": 128,
    "make_vocab_size_divisible_by": 64,
}
# Hugging Face configs of the families whose provide() is their own (tiny, as in their
# tests/test_hf_family_*.py): attention sinks and biased experts (gpt-oss), MLA with shared
# experts and a dense first layer (DeepSeek-V3), zero-centred and post-layer norms (Gemma 3).
HF_FAMILIES: dict[str, dict[str, Any]] = {
    "gemma3": {
        "model_type": "gemma3_text",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "max_position_embeddings": 64,
    },
    "deepseek_v3": {
        "model_type": "deepseek_v3",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 16,
        "q_lora_rank": 24,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "max_position_embeddings": 16,
        "tie_word_embeddings": False,
    },
    "gpt_oss": {
        "model_type": "gpt_oss",
        "vocab_size": 256,
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
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    },
}


def _provider(family: str, layout: dict[str, Any]) -> Any:
    from bridge.train.convert import provider_from_hf_config
    from bridge.train.models import MambaProvider, T5ModelProvider
    from bridge.train.testing import tiny_gpt_provider

    if family == "gpt":
        return tiny_gpt_provider(pipeline_dtype=torch.float32, **layout)
    if family == "t5":
        return T5ModelProvider(**T5, **layout)
    if family == "mamba":
        return MambaProvider(pipeline_dtype=torch.float32, **{**MAMBA, **layout})
    return provider_from_hf_config(
        HF_FAMILIES[family], seq_length=16, make_vocab_size_divisible_by=64, **layout
    )


def _shards(layout: dict[str, Any], layout_independent: bool, family: str = "gpt") -> list[Any]:
    """This rank's ``(key, global offset, prepend axes, tensor)`` for every parameter."""
    from bridge.config import RNGConfig
    from bridge.train.engine import build_engine
    from bridge.train.engine.initialize import destroy_distributed
    from bridge.train.models.layout_init import layout_independent_seed
    from bridge.train.testing import tiny_dist_config

    provider = _provider(family, layout)
    rng = RNGConfig(seed=7, layout_independent_init=layout_independent)
    engine = build_engine()
    engine.initialize_distributed(provider, tiny_dist_config(), rng)
    chunks = engine.setup_model(
        provider,
        wrap_with_ddp=False,
        layout_independent_seed=layout_independent_seed(rng, provider),
    )
    out = _collect(chunks)
    destroy_distributed()
    return out


def _collect(chunks: list[Any]) -> list[Any]:
    """``(key, global shape, global offset, local tensor)`` of every parameter shard."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    out = []
    for chunk in chunks:
        sharded_state_dict: Any = chunk.sharded_state_dict  # a megatron module's method
        for entry in nested_values(sharded_state_dict()):
            entries = entry.build() if isinstance(entry, ShardedTensorFactory) else [entry]
            for sharded in (
                nested_values(entries) if isinstance(entries, (dict, list)) else [entries]
            ):
                if not isinstance(sharded, ShardedTensor) or "_extra_state" in sharded.key:
                    continue
                local = (
                    sharded.data.detach()
                    .clone()
                    .reshape((1,) * sharded.prepend_axis_num + tuple(sharded.data.shape))
                )
                out.append((sharded.key, tuple(sharded.global_shape), sharded.global_offset, local))
    return out


def _assemble(per_rank: list[list[Any]]) -> dict[str, torch.Tensor]:
    full: dict[str, torch.Tensor] = {}
    for shards in per_rank:
        for key, shape, offset, local in shards:
            tensor = full.setdefault(key, torch.full(shape, float("nan")))
            index = tuple(slice(o, o + n) for o, n in zip(offset, local.shape, strict=True))
            tensor[index] = local
    return full


# Layouts of the other providers, each against its own ``dp2`` (one model-parallel rank).
# T5 refuses pipeline parallelism (T5ModelProvider), so it has no PP layout.
FAMILY_LAYOUTS: dict[str, dict[str, dict[str, Any]]] = {
    "t5": {"dp2": {}, "tp2": {"tensor_model_parallel_size": 2}},
    "mamba": {
        "dp2": {},
        "tp2": {"tensor_model_parallel_size": 2},
        "pp2": {"pipeline_model_parallel_size": 2},
        "pp2_vpp2": {
            "pipeline_model_parallel_size": 2,
            "virtual_pipeline_model_parallel_size": 2,
            "batch_p2p_comm": False,
            # megatron needs the virtual stages marked in the pattern; the same four layers.
            "hybrid_override_pattern": "M|*|M|-",
        },
    },
    **{
        family: {
            "dp2": {},
            "tp2": {"tensor_model_parallel_size": 2},
            "pp2": {"pipeline_model_parallel_size": 2},
            **({} if family == "gemma3" else {"ep2": {"expert_model_parallel_size": 2}}),
        }
        for family in HF_FAMILIES
    },
}

Job = tuple[str, str, bool]
"""``(family, layout name, layout-independent)``."""


def _layout(family: str, name: str) -> dict[str, Any]:
    return LAYOUTS[name] if family == "gpt" else FAMILY_LAYOUTS[family][name]


def _build_all(rank: int, world: int, jobs: list[Job]) -> list[Any]:
    return [
        _shards(_layout(family, name), independent, family) for family, name, independent in jobs
    ]


def _assert_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], name: str):
    assert sorted(got) == sorted(want), name
    for key in want:
        assert not torch.isnan(got[key]).any(), f"{name}: {key} has holes"
        assert torch.equal(got[key], want[key]), f"{name}: {key} differs"


def _base(family: str, name: str) -> str:
    if family != "gpt":
        return "dp2"
    return "moe_dp2" if name.startswith("moe") else "swiglu_dp2" if "swiglu" in name else "dp2"


def _check(jobs: list[tuple[str, str]], *, one_process: bool) -> None:
    """Build ``(family, layout)`` jobs on two ranks (one launch: start-up dominates) and
    compare each with its family's one-model-parallel-rank layout; with ``one_process``
    also that one with a one-process build."""
    wanted: list[Job] = [(family, name, True) for family, name in jobs]
    bases = sorted({(family, _base(family, name), True) for family, name in jobs} - set(wanted))
    per_stage = [("gpt", "pp2", False), ("gpt", "dp2", False)]
    every = wanted + bases + per_stage
    per_rank = run_distributed(_build_all, 2, every, timeout=900)
    built = {
        job: _assemble([per_rank[rank][i] for rank in range(2)]) for i, job in enumerate(every)
    }
    if one_process:
        singles = sorted({(family, _base(family, name), True) for family, name in jobs})
        (single,) = run_distributed(_build_all, 1, singles, timeout=600)
        for job, shards in zip(singles, single, strict=True):
            _assert_identical(_assemble([shards]), built[job], f"one process {job}")
    for family, name in jobs:
        base = built[(family, _base(family, name), True)]
        _assert_identical(built[(family, name, True)], base, f"{family} {name}")
    per_stage_weights = built[("gpt", "pp2", False)]
    assert any(
        not torch.equal(per_stage_weights[key], built[("gpt", "dp2", False)][key])
        for key in per_stage_weights
    ), "megatron's per-stage seeding gave the same weights: this test would not see a change"


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_initial_weights_are_the_same_under_pp_vpp_and_ep() -> None:
    """GPT (dense, MoE), T5 and hybrid Mamba in one launch."""
    _check(
        [
            ("gpt", "pp2_vpp2"),
            ("gpt", "moe_ep2"),
            ("t5", "tp2"),
            ("mamba", "tp2"),
            ("mamba", "pp2"),
        ],
        one_process=False,
    )


@pytest.mark.extended
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_initial_weights_are_the_same_under_every_layout() -> None:
    _check(
        [("gpt", name) for name in LAYOUTS]
        + [(family, name) for family, layouts in FAMILY_LAYOUTS.items() for name in layouts],
        one_process=True,
    )


# The mimo recipe's model (a patch encoder feeding a GPT): on one rank, and with each module
# under a layout of its own: split over two ranks, colocated with tensor parallelism, and on
# four ranks the encoder data-parallel while the language model is tensor-parallel
# (colocated modules must share tp and dp in bridge-mimo). One four-rank layout: a launch
# costs start-up. (Under heavy load, creating bridge-mimo's gloo groups on four ranks failed
# once here with "Failed to recv" and passed on the rerun; not investigated.)
MIMO_LAYOUTS: dict[str, tuple[int, dict[str, dict[str, Any]]]] = {
    "split": (2, {"vision": {"ranks": [0]}, "language": {"ranks": [1]}}),
    "colocated_tp2": (
        2,
        {"vision": {"ranks": range(2), "tp": 2}, "language": {"ranks": range(2), "tp": 2}},
    ),
    "vision_dp2_language_tp2": (
        4,
        {"vision": {"ranks": range(2), "dp": 2}, "language": {"ranks": range(2, 4), "tp": 2}},
    ),
}


def _mimo_shards(rank: int, world: int, names: list[str]) -> list[Any]:
    import bridge.mimo as mimo
    from bridge.train.models.mimo import MimoModelConfig, build_mimo_recipe_model

    out = []
    for name in names:
        _, placements = MIMO_LAYOUTS.get(name) or (
            1,
            {"vision": {"ranks": [0]}, "language": {"ranks": [0]}},
        )
        layout = mimo.MimoLayout(
            {module: mimo.ModulePlacement(**where) for module, where in placements.items()}
        )
        infra = mimo.build_megatron_mimo_infra(layout)
        model = build_mimo_recipe_model(MimoModelConfig(), infra, seed=3, layout_seed=7)
        out.append(_collect([model]))
    return out


@pytest.mark.extended
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_mimo_modules_start_the_same_under_their_own_layouts() -> None:
    (single,) = run_distributed(_mimo_shards, 1, ["one_process"], timeout=300)
    want = _assemble([single[0]])
    assert any(key.startswith("language_model.") for key in want), sorted(want)[:5]
    assert any(key.startswith("modality_submodules.vision.") for key in want), sorted(want)[:5]
    for world in (2, 4):
        names = [name for name, (size, _) in MIMO_LAYOUTS.items() if size == world]
        per_rank = run_distributed(_mimo_shards, world, names, timeout=600)
        for i, name in enumerate(names):
            got = _assemble([per_rank[rank][i] for rank in range(world)])
            _assert_identical(got, want, name)
