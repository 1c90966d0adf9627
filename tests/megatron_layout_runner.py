"""Train one tiny GPT in several parallel layouts on the megatron engine (CPU, gloo).

Run bare (one process) or under ``torchrun``; used by ``tests/megatron_p2p_runner.py``::

    python tests/megatron_layout_runner.py OUT.json LAYOUT [LAYOUT ...]
    torchrun --nproc-per-node=2 tests/megatron_layout_runner.py OUT.json dp2 pp2 ...

It drives the engine API directly (``bridge-train`` itself refuses some of the layouts
``tests/megatron_p2p_runner.py`` adds to show why); the layout matrix through ``bridge-train``
is ``tests/test_megatron_engine_layouts.py``. Every layout runs in the same process group one
after the other (process start-up is the expensive part on CPU): megatron's parallel state is
rebuilt for each. Weights come from the engine's layout-independent initialisation
(``setup_model(layout_independent_seed=...)``, what ``rng.layout_independent_init`` selects),
so the one-process run and every parallel layout start from the same global weights. The data
is megatron's mock GPT data with the same seed and global batch everywhere.

OUT.json maps each layout to ``{"losses": [...], "grad_norms": [...]}`` (per step, from the
last pipeline stage, identical on all of its ranks).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.distributed as dist

STEPS = 10
GLOBAL_BATCH = 8
MICRO_BATCH = 2

# name -> (model overrides, ddp overrides, optimizer overrides)
LAYOUTS: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {
    "single": ({}, {}, {}),
    "single_bf16": ({"bf16": True}, {}, {"bf16": True}),
    "dp2": ({}, {}, {}),
    "dp2_bf16": ({"bf16": True}, {}, {"bf16": True}),
    "dp2_overlap": ({}, {"overlap_grad_reduce": True, "bucket_size": 2000}, {}),
    "dp2_distopt": (
        {},
        {
            "use_distributed_optimizer": True,
            "overlap_grad_reduce": True,
            "overlap_param_gather": True,
            "bucket_size": 2000,
        },
        {"use_distributed_optimizer": True},
    ),
    "tp2": ({"tensor_model_parallel_size": 2}, {}, {}),
    "pp2": ({"pipeline_model_parallel_size": 2}, {}, {}),
    "pp2_bf16": ({"pipeline_model_parallel_size": 2, "bf16": True}, {}, {"bf16": True}),
    # A virtual pipeline over PP=2 with unbatched p2p: with the default batch_p2p_comm=True
    # the previous and next stage are the same rank and the batched sends/receives swap
    # activations and gradients (see docs/engines.md).
    "pp2_vpp2": (
        {
            "pipeline_model_parallel_size": 2,
            "virtual_pipeline_model_parallel_size": 2,
            "batch_p2p_comm": False,
        },
        {},
        {},
    ),
    "tp2_pp2": ({"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}, {}, {}),
    "dp2_pp2_distopt": (
        {"pipeline_model_parallel_size": 2},
        {
            "use_distributed_optimizer": True,
            "overlap_grad_reduce": True,
            "overlap_param_gather": True,
        },
        {"use_distributed_optimizer": True},
    ),
    # MoE: megatron's SequentialMLP experts (local spec). add_bias_linear=False: with biases,
    # megatron-core 0.19.2's expert MLP adds the bias in place to the output of a
    # tensor-parallel reduce that (at expert TP=1) returns its input as a view, which
    # autograd forbids, on any device.
    "moe": ({"num_moe_experts": 4, "moe_router_topk": 2, "add_bias_linear": False}, {}, {}),
    "moe_ep2": (
        {
            "num_moe_experts": 4,
            "moe_router_topk": 2,
            "add_bias_linear": False,
            "expert_model_parallel_size": 2,
        },
        {},
        {},
    ),
    "moe_ep2_alltoall": (
        {
            "num_moe_experts": 4,
            "moe_router_topk": 2,
            "add_bias_linear": False,
            "expert_model_parallel_size": 2,
            "moe_token_dispatcher_type": "alltoall",
        },
        {},
        {},
    ),
    "sp_tp2": ({"tensor_model_parallel_size": 2, "sequence_parallel": True}, {}, {}),
    "tp2_pp2_vpp2": (
        {
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 2,
            "virtual_pipeline_model_parallel_size": 2,
            "batch_p2p_comm": False,
        },
        {},
        {},
    ),
}


def run_layout(name: str) -> dict[str, list[float]]:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig

    from bridge.train.engine import build_engine
    from bridge.train.loop.bare_loop import train_steps
    from bridge.train.state import GlobalState
    from bridge.train.testing import (
        tiny_dist_config,
        tiny_gpt_provider,
        tiny_mock_iterator,
        tiny_optimizer_config,
        tiny_rng_config,
        tiny_scheduler_config,
        tiny_train_config,
    )

    model_overrides, ddp_overrides, optimizer_overrides = LAYOUTS[name]
    dtype = torch.bfloat16 if model_overrides.get("bf16") else torch.float32
    provider = tiny_gpt_provider(num_layers=4, pipeline_dtype=dtype, **model_overrides)
    train_config = tiny_train_config(
        train_iters=STEPS, global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH
    )
    engine = build_engine()
    engine.initialize_distributed(provider, tiny_dist_config(), tiny_rng_config())
    model = engine.setup_model(
        provider,
        DistributedDataParallelConfig(**ddp_overrides),
        layout_independent_seed=tiny_rng_config().seed,
    )
    optimizer, scheduler = engine.setup_optimizer(
        model,
        tiny_optimizer_config(**optimizer_overrides),
        tiny_scheduler_config(lr_warmup_iters=2),
        train_config,
    )
    state = GlobalState()
    iterator = tiny_mock_iterator(train_config, train_state=state.train_state)
    result = train_steps(
        engine,
        model,
        optimizer,
        scheduler,
        iterator,
        train_iters=STEPS,
        global_batch_size=GLOBAL_BATCH,
        micro_batch_size=MICRO_BATCH,
        seq_length=provider.seq_length,
        train_state=state.train_state,
    )
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    mine = {"losses": result.losses, "grad_norms": result.grad_norms} if last else None
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    reports = [r for r in gathered if r is not None]
    # Every last-stage rank must report the same numbers (they are reduced over DP).
    assert all(r == reports[0] for r in reports), f"{name}: ranks disagree: {reports}"
    return reports[0]


def main() -> None:
    out_path, names = sys.argv[1], sys.argv[2:]
    results = {name: run_layout(name) for name in names}
    from bridge.train.engine.initialize import destroy_distributed

    rank = dist.get_rank()
    destroy_distributed()
    if rank == 0:
        with open(out_path, "w", encoding="utf-8") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
