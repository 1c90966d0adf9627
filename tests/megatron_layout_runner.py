"""Train one tiny GPT in several parallel layouts on the megatron engine (CPU, gloo).

Run bare (one process) or under ``torchrun``; used by ``tests/test_megatron_engine_layouts.py``::

    python tests/megatron_layout_runner.py OUT.json LAYOUT [LAYOUT ...]
    torchrun --nproc-per-node=2 tests/megatron_layout_runner.py OUT.json dp2 pp2 ...

Every layout runs in the same process group one after the other (process start-up is the
expensive part on CPU): megatron's parallel state is rebuilt for each. Weights come from a
layout-independent initialisation: every tensor of the model's ``sharded_state_dict`` is the
slice, at its global offset, of a full tensor drawn from a generator seeded by the tensor's
global key. So the one-process run and every parallel layout start from the same global
weights (a plain seed would not do: the trainer seeds pipeline stages differently, and
tensor-parallel shards of fused weights are laid out per rank). The data is megatron's mock
GPT data with the same seed and global batch everywhere.

OUT.json maps each layout to ``{"losses": [...], "grad_norms": [...]}`` (per step, from the
last pipeline stage, identical on all of its ranks).
"""

from __future__ import annotations

import hashlib
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


def _seed_of(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") % (2**63)


def _global_tensor(key: str, shape: tuple[int, ...], data_ndim: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(_seed_of(key))
    noise = torch.randn(shape, generator=generator, dtype=torch.float64)
    if data_ndim >= 2:
        return 0.05 * noise
    if "norm" in key and key.endswith("weight"):
        return 1.0 + 0.1 * noise
    return 0.02 * noise


def layout_independent_init(chunks: list[torch.nn.Module]) -> None:
    """Set every parameter to its slice of a global tensor seeded by its sharded key."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    seen = 0
    for chunk in chunks:
        sharded_state: Any = chunk.sharded_state_dict  # a megatron module's method
        for sharded in nested_values(sharded_state()):
            if not isinstance(sharded, ShardedTensor) or sharded.data is None:
                continue
            if "_extra_state" in sharded.key or not sharded.data.is_floating_point():
                continue
            assert sharded.flattened_range is None, sharded.key
            full = _global_tensor(sharded.key, tuple(sharded.global_shape), sharded.data.ndim)
            local = (1,) * sharded.prepend_axis_num + tuple(sharded.data.shape)
            index = tuple(
                slice(offset, offset + size)
                for offset, size in zip(sharded.global_offset, local, strict=True)
            )
            with torch.no_grad():
                sharded.data.copy_(full[index].reshape(sharded.data.shape))
            seen += 1
    assert seen, "no parameter was initialised"


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
        pre_wrap_hooks=[layout_independent_init],
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
        state=state,
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
