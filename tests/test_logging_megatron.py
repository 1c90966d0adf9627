"""bridge.logging's gradient norms on real megatron-core GPTModels.

TP=2 equals TP=1 after a real backward; and on an MoE model with expert parallelism 2,
built by megatron-core (which marks expert parameters ``allreduce=False`` and keeps its
``ProcessGroupCollection`` on the model), the global norm equals the norm of every dense
parameter once plus every expert of every rank. megatron-core's MoE router runs only on
CUDA, so that model gets known gradients instead of a backward.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from core_utils.testing import run_distributed

pytest.importorskip("megatron.core")  # the integration venv always has it

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from bridge.logging import report_l2_norm_grad
from core_utils.portable_attention import with_sdpa_core_attention


def _grad_norms(rank: int, world_size: int) -> tuple[dict[str, float], int]:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        # use_cpu_initialization: every TP rank slices the same full master weights, so
        # TP=1 and TP=2 start equal and their gradients are slices of the same tensors.
        torch.manual_seed(1234)
        config = TransformerConfig(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_query_groups=2,
            use_cpu_initialization=True,
            attention_dropout=0.0,
            hidden_dropout=0.0,
            tensor_model_parallel_size=world_size,
        )
        model = GPTModel(
            config=config,
            transformer_layer_spec=with_sdpa_core_attention(get_gpt_layer_local_spec()),
            vocab_size=64,
            max_sequence_length=16,
        )
        gen = torch.Generator().manual_seed(7)
        tokens = torch.randint(0, 64, (2, 16), generator=gen)
        labels = torch.randint(0, 64, (2, 16), generator=gen)
        position_ids = torch.arange(16).unsqueeze(0).expand(2, -1)
        model(tokens, position_ids, None, labels=labels).float().mean().backward()
        sharded = sum(bool(getattr(p, "tensor_model_parallel", False)) for p in model.parameters())
        # No groups passed: they come from the model's own pg_collection (mp and tp).
        return report_l2_norm_grad([model]), sharded
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_global_and_per_parameter_grad_norms_match_across_tensor_parallel_sizes() -> None:
    ((single, _),) = run_distributed(_grad_norms, 1, timeout=150)
    tp2 = run_distributed(_grad_norms, 2, timeout=180)
    assert math.isfinite(single["l2_norm/grad/global"]) and single["l2_norm/grad/global"] > 0
    for report, sharded in tp2:
        assert sharded > 0  # megatron marked its TP shards
        assert set(report) == set(single)
        for name, value in single.items():
            assert report[name] == pytest.approx(value, rel=1e-4, abs=1e-7), name


def _grad_seed(name: str, expert_owner: int | None) -> int:
    # Dense parameters are replicas (the same gradient on every rank); each rank's experts
    # are its own.
    return zlib.crc32(name.encode()) + (0 if expert_owner is None else 1000 * (expert_owner + 1))


def _known_grad(name: str, shape: tuple[int, ...], expert_owner: int | None) -> torch.Tensor:
    generator = torch.Generator().manual_seed(_grad_seed(name, expert_owner))
    return torch.randn(shape, generator=generator)


def _moe_norms(rank: int, world_size: int) -> tuple[list[tuple[str, tuple[int, ...], bool]], float]:
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world_size)
    try:
        config = TransformerConfig(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            use_cpu_initialization=True,
            num_moe_experts=4,
            moe_router_topk=2,
            expert_model_parallel_size=world_size,
            add_bias_linear=False,
        )
        spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
        model = GPTModel(
            config=config,
            transformer_layer_spec=with_sdpa_core_attention(spec),
            vocab_size=64,
            max_sequence_length=16,
        )
        params = []
        for name, param in model.named_parameters():
            expert = not getattr(param, "allreduce", True)
            param.grad = _known_grad(name, tuple(param.shape), rank if expert else None)
            params.append((name, tuple(param.shape), expert))
        # No groups passed: mp, tp, expt_tp and tp_ep_pp come from the model.
        return params, report_l2_norm_grad([model])["l2_norm/grad/global"]
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_expert_parallel_global_norm_counts_every_expert_once() -> None:
    results = run_distributed(_moe_norms, 2, timeout=180)
    squares = 0.0
    for rank, (params, _) in enumerate(results):
        assert [n for n, _, e in params if e], "megatron-core marked no expert parameter"
        for name, shape, expert in params:
            if expert or rank == 0:  # dense replicas once, each rank's experts
                owner = rank if expert else None
                squares += float(_known_grad(name, shape, owner).double().pow(2).sum())
    for _, norm in results:
        assert norm == pytest.approx(math.sqrt(squares), rel=1e-6)
