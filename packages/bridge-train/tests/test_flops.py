"""num_floating_point_operations against a hand count and against torch's FLOP counter.

What each side counts:

* ``num_floating_point_operations``: every GEMM of the model (QKV / output projections,
  MLP, logits) at 2 FLOPs per multiply-accumulate, x3 for forward + backward, plus the two
  attention matmuls with the causal discount (each query sees ``s / 2`` keys on average).
* ``FlopCounterMode``: the FLOPs of every matmul-like aten op actually executed in the
  forward and backward pass. torch has no formula for the CPU SDPA kernel
  (``_scaled_dot_product_flash_attention_for_cpu``), so the test registers torch's own SDPA
  formulas for it. They count the full ``s x s`` score matrix (no causal discount: the CPU
  kernel does compute it), and count the attention backward as 2.5x its forward (the
  flash-attention backward recomputes the scores) where the formula uses 2x.

So the linear (GEMM) parts must agree exactly, and the counter's attention-core FLOPs must be
exactly ``2 (no causal discount) x 3.5 / 3 (backward 2.5x instead of 2x)`` times the
formula's causal count. The test asserts both to 1e-9 relative.
"""

from __future__ import annotations

import pytest
import torch

from bridge.train import GPTModelProvider
from bridge.train.metrics.flops import num_floating_point_operations
from bridge.train.models.mla_provider import MLAModelProvider
from bridge.train.testing import tiny_gpt_provider
from core_utils.testing import run_distributed


def _hand_count(
    b, s, layers, h, heads, groups, ffn, vocab, gated, topk=None, moe_layers=0, moe_ffn=None
):
    d = h // heads
    q, kv = d * heads, d * groups
    qkv = h * (q + 2 * kv)
    out = q * h
    core = q * s  # causal: 2 matmuls x s/2
    dense_layers = layers - moe_layers
    mlp = h * ffn * (3 if gated else 2) * dense_layers
    if moe_layers:
        mlp += h * moe_ffn * topk * (3 if gated else 2) * moe_layers
    logits = h * vocab
    return 6 * b * s * (layers * (qkv + out + core) + mlp + logits)


@pytest.mark.parametrize(
    ("gated", "groups"),
    [(False, 4), (True, 2), (True, 1)],
)
def test_dense_gpt_flops_match_a_hand_count(gated: bool, groups: int) -> None:
    provider = tiny_gpt_provider(
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=groups,
        seq_length=32,
        ffn_hidden_size=96,
        gated_linear_unit=gated,
        vocab_size=200,
        make_vocab_size_divisible_by=128,
    )
    expected = _hand_count(8, 32, 2, 64, 4, groups, 96, 256, gated)
    assert num_floating_point_operations(provider, 8) == expected
    # A config container with a ``model`` attribute works too.
    container = type("C", (), {"model": provider})()
    assert num_floating_point_operations(container, 8) == expected


def test_moe_layers_count_routed_and_shared_experts() -> None:
    provider = tiny_gpt_provider(
        hidden_size=64,
        num_attention_heads=4,
        seq_length=32,
        ffn_hidden_size=96,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=48,
        moe_layer_freq=[1, 0],
        vocab_size=128,
    )
    base = _hand_count(4, 32, 2, 64, 4, 4, 96, 128, False, topk=2, moe_layers=1, moe_ffn=48)
    assert num_floating_point_operations(provider, 4) == base
    provider.moe_shared_expert_intermediate_size = 32
    shared = 6 * 4 * 32 * 64 * 32 * 2  # one MoE layer, two projections of 64 x 32
    assert num_floating_point_operations(provider, 4) == base + shared


def test_flops_scale_with_batch_and_reject_bad_input() -> None:
    provider = tiny_gpt_provider()
    one = num_floating_point_operations(provider, 1)
    assert num_floating_point_operations(provider, 5) == 5 * one
    assert num_floating_point_operations(provider, 0) == 0
    with pytest.raises(ValueError, match=r"vocab_size"):
        num_floating_point_operations(GPTModelProvider(), 1)
    with pytest.raises(ValueError, match=r"batch_size"):
        num_floating_point_operations(provider, -1)


def _count_with_torch(rank: int, world: int, providers: list[GPTModelProvider], batch: int):
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    from bridge.train.engine.initialize import initialize_distributed
    from bridge.train.testing import tiny_dist_config

    def sdpa_fwd(query_shape, key_shape, value_shape, *args, **kwargs) -> int:
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    def sdpa_bwd(grad_out_shape, query_shape, key_shape, value_shape, *args, **kwargs) -> int:
        return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)

    aten = torch.ops.aten
    mapping = {
        aten._scaled_dot_product_flash_attention_for_cpu: sdpa_fwd,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: sdpa_bwd,
    }
    initialize_distributed(providers[0], tiny_dist_config())
    counts = []
    for provider in providers:  # one layout (one process), so one parallel state serves all
        model = provider.provide()
        s = provider.seq_length
        assert provider.vocab_size is not None
        tokens = torch.randint(0, provider.vocab_size, (batch, s))
        positions = torch.arange(s).expand(batch, s)
        with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
            model(tokens, positions, None, labels=tokens).float().sum().backward()
        counts.append({str(op): int(n) for op, n in counter.get_flop_counts()["Global"].items()})
    return counts


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_flops_match_torch_flop_counter_on_a_real_forward_backward() -> None:
    provider = tiny_gpt_provider(
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        seq_length=32,
        ffn_hidden_size=96,
        gated_linear_unit=True,
        vocab_size=200,
    )
    # Multi-latent attention (DeepSeek-V3's): query/key heads of 16 + 8 channels, value
    # heads of 12, both low-rank projections.
    latent = MLAModelProvider(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=32,
        ffn_hidden_size=96,
        gated_linear_unit=True,
        vocab_size=200,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_head_dim=16,
        qk_pos_emb_head_dim=8,
        v_head_dim=12,
        rope_type="rope",
        normalization="RMSNorm",
        bias_activation_fusion=False,
        apply_rope_fusion=False,
    )
    batch = 2
    ((by_op, latent_by_op),) = run_distributed(
        _count_with_torch, 1, [provider, latent], batch, timeout=150
    )
    attention = sum(n for op, n in by_op.items() if "scaled_dot_product" in op)
    gemm = sum(n for op, n in by_op.items() if "scaled_dot_product" not in op)
    formula = num_floating_point_operations(provider, batch)
    causal_core = 6 * batch * 32 * 2 * (16 * 4) * 32  # 6 x tokens x layers x q x s
    assert gemm == pytest.approx(formula - causal_core, rel=1e-9)
    assert attention == pytest.approx(2 * causal_core * 3.5 / 3, rel=1e-9)
    # Query/key and value heads of different widths take SDPA's math kernel: its score and
    # value matmuls are counted as plain matmuls over the full s x s (twice the causal
    # count, backward 2x forward), so the counter's matmuls are the formula plus one
    # causal core: 6 x tokens x layers x (q/k width + v width) x s / 2.
    assert not any("scaled_dot_product_flash" in op for op in latent_by_op)
    latent_core = 6 * batch * 32 * 2 * (4 * (16 + 8) + 4 * 12) * 32 / 2
    latent_formula = num_floating_point_operations(latent, batch)
    assert sum(latent_by_op.values()) == pytest.approx(latent_formula + latent_core, rel=1e-9)
