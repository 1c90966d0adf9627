"""core_utils.portable_attention against explicit attention math and inside a GPTModel."""

from __future__ import annotations

import math

import pytest
import torch

from core_utils.testing import run_distributed

megatron = pytest.importorskip("megatron.core")  # the integration venv always has it

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402

from core_utils.portable_attention import SDPACoreAttention, with_sdpa_core_attention  # noqa: E402


class _TP1:
    class tp:  # mimics ProcessGroupCollection.tp
        @staticmethod
        def size() -> int:
            return 1


def _config(**overrides) -> TransformerConfig:
    base = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        use_cpu_initialization=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    base.update(overrides)
    return TransformerConfig(**base)


def _reference(q, k, v, masked, causal, scale):
    # q: [sq, b, n, h]; k, v: [sk, b, g, h]; masked: [b, 1, sq, sk] True = do not attend
    rep = q.size(2) // k.size(2)
    k = k.repeat_interleave(rep, dim=2)
    v = v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("qbnh,kbnh->bnqk", q, k) * scale
    sq, sk = scores.shape[-2:]
    if causal:
        scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1), -math.inf)
    if masked is not None:
        scores = scores.masked_fill(masked, -math.inf)
    out = torch.einsum("bnqk,kbnh->qbnh", scores.softmax(-1), v)
    return out.reshape(sq, q.size(1), -1)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("with_mask", [True, False])
def test_sdpa_core_attention_matches_explicit_attention(causal: bool, with_mask: bool) -> None:
    torch.manual_seed(0)
    cfg = _config()
    mask_type = AttnMaskType.causal if causal else AttnMaskType.padding
    attn = SDPACoreAttention(cfg, 1, mask_type, "self", pg_collection=_TP1())
    sq, b, n, g, h = 6, 3, 4, 2, 8
    q, k, v = torch.randn(sq, b, n, h), torch.randn(sq, b, g, h), torch.randn(sq, b, g, h)
    masked = None
    if with_mask:
        masked = torch.zeros(b, 1, sq, sq, dtype=torch.bool)
        masked[1, :, :, -2:] = True  # second sample: last two keys are padding
        masked[..., 0] = False  # every query keeps at least one key
    got = attn(q, k, v, masked)
    want = _reference(q, k, v, masked, causal, 1 / math.sqrt(h))
    assert got.shape == (sq, b, n * h)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("skip", "windowed_layers"), [(None, {1, 2, 3}), (3, {1, 2}), ([0, 1, 0], {2})]
)
def test_sliding_window_on_the_layers_window_attn_skip_freq_names(
    skip: int | list[int] | None, windowed_layers: set[int]
) -> None:
    """A window of 2 (the query and one key before it) on the layers megatron's rule picks;
    full causal attention on the others."""
    torch.manual_seed(2)
    cfg = _config(num_layers=3, window_size=(1, 0), window_attn_skip_freq=skip)
    sq, b, n, g, h = 6, 2, 4, 2, 8
    q, k, v = torch.randn(sq, b, n, h), torch.randn(sq, b, g, h), torch.randn(sq, b, g, h)
    outside = torch.ones(sq, sq, dtype=torch.bool).tril(-2)[None, None].expand(b, 1, sq, sq)
    for layer in (1, 2, 3):
        attn = SDPACoreAttention(cfg, layer, AttnMaskType.causal, "self", pg_collection=_TP1())
        masked = outside if layer in windowed_layers else None
        want = _reference(q, k, v, masked, True, 1 / math.sqrt(h))
        torch.testing.assert_close(attn(q, k, v, None), want, rtol=1e-5, atol=1e-5)


def test_cross_attention_with_padding_and_fully_masked_rows_matches_megatron_softmax() -> None:
    # Decoder queries (5) attend to encoder keys (7) with one head per query head even though
    # self-attention groups queries; padded query rows (all keys masked) attend uniformly, as
    # megatron's masked softmax (fill -10000) does, instead of giving NaN.
    torch.manual_seed(1)
    cfg = _config()
    attn = SDPACoreAttention(cfg, 1, AttnMaskType.arbitrary, "cross", pg_collection=_TP1())
    sq, sk, b, n, h = 5, 7, 2, 4, 8
    q, k, v = torch.randn(sq, b, n, h), torch.randn(sk, b, n, h), torch.randn(sk, b, n, h)
    masked = torch.zeros(b, 1, sq, sk, dtype=torch.bool)
    masked[0, :, :, -3:] = True  # padded encoder positions
    masked[1, :, -2:, :] = True  # padded decoder positions: nothing to attend to
    got = attn(q, k, v, masked)
    scores = torch.einsum("qbnh,kbnh->bnqk", q, k) / math.sqrt(h)
    probs = scores.masked_fill(masked, -10000.0).softmax(-1)
    want = torch.einsum("bnqk,kbnh->qbnh", probs, v).reshape(sq, b, n * h)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_with_sdpa_core_attention_also_swaps_cross_attention() -> None:
    from megatron.core.models.T5.t5_spec import decoder_model_with_local_spec

    new = with_sdpa_core_attention(decoder_model_with_local_spec())
    assert new.submodules.self_attention.submodules.core_attention is SDPACoreAttention
    assert new.submodules.cross_attention.submodules.core_attention is SDPACoreAttention


def test_with_sdpa_core_attention_copies_the_spec() -> None:
    spec = get_gpt_layer_local_spec()
    before = spec.submodules.self_attention.submodules.core_attention
    new = with_sdpa_core_attention(spec)
    assert new.submodules.self_attention.submodules.core_attention is SDPACoreAttention
    assert spec.submodules.self_attention.submodules.core_attention is before
    with pytest.raises(ValueError, match="core_attention"):
        with_sdpa_core_attention(object())


def test_context_parallel_is_refused_with_a_clear_message() -> None:
    cfg = _config()
    cfg.context_parallel_size = 2
    with pytest.raises(ValueError, match="context_parallel_size=2"):
        SDPACoreAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=_TP1())


def _gpt_loss(rank: int, world_size: int) -> tuple[float, float]:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        # With use_cpu_initialization every TP rank slices the same full master weight,
        # so TP=1 and TP=2 start from identical parameters.
        torch.manual_seed(1234)
        cfg = _config(tensor_model_parallel_size=world_size)
        model = GPTModel(
            config=cfg,
            transformer_layer_spec=with_sdpa_core_attention(get_gpt_layer_local_spec()),
            vocab_size=64,
            max_sequence_length=16,
        )
        gen = torch.Generator().manual_seed(7)
        tokens = torch.randint(0, 64, (2, 16), generator=gen)
        labels = torch.randint(0, 64, (2, 16), generator=gen)
        position_ids = torch.arange(16).unsqueeze(0).expand(2, -1)
        loss = model(tokens, position_ids, None, labels=labels).float().mean()
        loss.backward()
        grad_sq = sum(
            float(p.grad.float().pow(2).sum())
            for p in model.parameters()
            if p.grad is not None and getattr(p, "tensor_model_parallel", False) is False
        )
        return float(loss), grad_sq
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_gpt_model_runs_on_cpu_and_tensor_parallel_matches_single_process() -> None:
    (single,) = run_distributed(_gpt_loss, 1, timeout=120)
    tp2 = run_distributed(_gpt_loss, 2, timeout=150)
    assert math.isfinite(single[0])
    for loss, replicated_grad_sq in tp2:
        assert loss == pytest.approx(single[0], rel=1e-5)
        # Parameters replicated across TP (layer norms, ...) get the same gradient.
        assert replicated_grad_sq == pytest.approx(single[1], rel=1e-4)
