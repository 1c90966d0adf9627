"""Layout-independent initialisation: the same seed gives bit-identical global weights.

Two forked ranks build the tiny GPT (dense and MoE, 4 layers) with megatron-core's engine
under several layouts, one after the other in the same process group; each rank reports
its shards (the model's ``sharded_state_dict``: key, global offset, local tensor) and the
shards are put together into global tensors. Every layout must give the same global
tensors, bit for bit, as the layout with one model-parallel rank (DP=2), and (extended tier)
that one equals a one-process build. megatron's per-stage seeding (``rng.layout_independent_init=false``)
is shown to differ under PP=2, so the check can fail.
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


def _shards(layout: dict[str, Any], layout_independent: bool) -> list[Any]:
    """This rank's ``(key, global offset, prepend axes, tensor)`` for every parameter."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    from bridge.config import RNGConfig
    from bridge.train.engine import build_engine
    from bridge.train.engine.initialize import destroy_distributed
    from bridge.train.models.layout_init import layout_independent_seed
    from bridge.train.testing import tiny_dist_config, tiny_gpt_provider

    provider = tiny_gpt_provider(pipeline_dtype=torch.float32, **layout)
    rng = RNGConfig(seed=7, layout_independent_init=layout_independent)
    engine = build_engine()
    engine.initialize_distributed(provider, tiny_dist_config(), rng)
    chunks = engine.setup_model(
        provider,
        wrap_with_ddp=False,
        layout_independent_seed=layout_independent_seed(rng, provider),
    )
    out = []
    for chunk in chunks:
        sharded_state_dict: Any = chunk.sharded_state_dict  # a megatron module's method
        for entry in nested_values(sharded_state_dict()):
            entries = entry.build() if isinstance(entry, ShardedTensorFactory) else [entry]
            for sharded in entries if isinstance(entries, list) else [entries]:
                if not isinstance(sharded, ShardedTensor) or "_extra_state" in sharded.key:
                    continue
                local = (
                    sharded.data.detach()
                    .clone()
                    .reshape((1,) * sharded.prepend_axis_num + tuple(sharded.data.shape))
                )
                out.append((sharded.key, tuple(sharded.global_shape), sharded.global_offset, local))
    destroy_distributed()
    return out


def _assemble(per_rank: list[list[Any]]) -> dict[str, torch.Tensor]:
    full: dict[str, torch.Tensor] = {}
    for shards in per_rank:
        for key, shape, offset, local in shards:
            tensor = full.setdefault(key, torch.full(shape, float("nan")))
            index = tuple(slice(o, o + n) for o, n in zip(offset, local.shape, strict=True))
            tensor[index] = local
    return full


def _build_all(rank: int, world: int, jobs: list[tuple[str, bool]]) -> list[Any]:
    return [_shards(LAYOUTS[name], independent) for name, independent in jobs]


def _assert_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], name: str):
    assert sorted(got) == sorted(want), name
    for key in want:
        assert not torch.isnan(got[key]).any(), f"{name}: {key} has holes"
        assert torch.equal(got[key], want[key]), f"{name}: {key} differs"


def _check(layouts: list[str], *, one_process: bool) -> None:
    jobs = [(name, True) for name in layouts] + [("pp2", False), ("dp2", False)]
    per_rank = run_distributed(_build_all, 2, jobs, timeout=360)
    built = {job: _assemble([per_rank[rank][i] for rank in range(2)]) for i, job in enumerate(jobs)}
    if one_process:
        (single,) = run_distributed(_build_all, 1, [("dp2", True)], timeout=120)
        _assert_identical(_assemble([single[0]]), built[("dp2", True)], "one process")
    for name in layouts:
        base = "moe_dp2" if name.startswith("moe") else "swiglu_dp2" if "swiglu" in name else "dp2"
        _assert_identical(built[(name, True)], built[(base, True)], name)
    per_stage = built[("pp2", False)]
    assert any(not torch.equal(per_stage[key], built[("dp2", False)][key]) for key in per_stage), (
        "megatron's per-stage seeding gave the same weights: this test would not see a change"
    )


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_initial_weights_are_the_same_under_pp_vpp_and_ep() -> None:
    _check(["dp2", "pp2_vpp2", "moe_dp2", "moe_ep2"], one_process=False)


@pytest.mark.extended
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_initial_weights_are_the_same_under_every_layout() -> None:
    _check(list(LAYOUTS), one_process=True)
