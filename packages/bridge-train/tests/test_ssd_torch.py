"""The torch SSD scan and causal convolution against a direct sequential recurrence."""

from __future__ import annotations

import pytest
import torch

from bridge.train.models.ssd_torch import causal_depthwise_conv1d, ssd_chunked_scan


def _sequential_scan(x, dt, A, B, C, D):
    """h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T; y_t = h_t C_t + D x_t, one step at a time."""
    batch, seq, heads, headdim = x.shape
    per_group = heads // B.size(2)
    B = B.repeat_interleave(per_group, dim=2)
    C = C.repeat_interleave(per_group, dim=2)
    h = x.new_zeros(batch, heads, headdim, B.size(-1))
    ys = []
    for t in range(seq):
        decay = torch.exp(dt[:, t] * A)[:, :, None, None]
        h = decay * h + (dt[:, t, :, None, None] * x[:, t, :, :, None] * B[:, t, :, None, :])
        ys.append(torch.einsum("bhpn,bhn->bhp", h, C[:, t]) + D[:, None] * x[:, t])
    return torch.stack(ys, dim=1)


def _sequential_conv(x, weight, bias):
    width = weight.size(-1)
    out = torch.zeros_like(x)
    for t in range(x.size(-1)):
        for k in range(width):
            src = t - (width - 1) + k
            if src >= 0:
                out[..., t] = out[..., t] + weight[:, 0, k] * x[..., src]
    return out + bias[:, None]


@pytest.mark.parametrize(("seq", "chunk"), [(16, 16), (23, 8), (9, 4), (7, 32)])
def test_chunked_scan_equals_the_sequential_recurrence_with_gradients(seq, chunk) -> None:
    gen = torch.Generator().manual_seed(seq * 31 + chunk)
    batch, heads, headdim, groups, state = 2, 4, 3, 2, 5

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).requires_grad_()

    x = rand(batch, seq, heads, headdim)
    dt = torch.nn.functional.softplus(rand(batch, seq, heads)).detach().requires_grad_()
    A = (-torch.rand(heads, generator=gen, dtype=torch.float64) * 2 - 0.1).requires_grad_()
    B = rand(batch, seq, groups, state)
    C = rand(batch, seq, groups, state)
    D = rand(heads)
    inputs = (x, dt, A, B, C, D)

    got = ssd_chunked_scan(x, dt, A, B, C, chunk, D=D)
    want = _sequential_scan(x, dt, A, B, C, D)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    upstream = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    grads_got = torch.autograd.grad(got, inputs, upstream)
    grads_want = torch.autograd.grad(want, inputs, upstream)
    for name, g, w in zip(["x", "dt", "A", "B", "C", "D"], grads_got, grads_want, strict=True):
        assert g is not None and torch.isfinite(g).all(), name
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5, msg=f"gradient of {name}")


def test_chunked_scan_in_fp32_matches_fp64_recurrence() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 40, 2, 4, generator=gen)
    dt = torch.nn.functional.softplus(torch.randn(1, 40, 2, generator=gen))
    A = -torch.rand(2, generator=gen) - 0.5
    B, C = torch.randn(2, 1, 40, 1, 3, generator=gen)
    D = torch.ones(2)
    got = ssd_chunked_scan(x, dt, A, B, C, 16, D=D)
    want = _sequential_scan(*(t.double() for t in (x, dt, A, B, C, D)))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_causal_conv_sees_only_the_past_and_matches_a_loop() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 11, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 1, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(6, generator=gen, dtype=torch.float64, requires_grad=True)
    got = causal_depthwise_conv1d(x, weight, bias)
    want = _sequential_conv(x, weight, bias)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    grads = torch.autograd.grad(got.sum(), (x, weight, bias))
    ref = torch.autograd.grad(want.sum(), (x, weight, bias))
    for g, w in zip(grads, ref, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)
    shifted = x.detach().clone()
    shifted[..., 7:] += 1.0
    torch.testing.assert_close(
        causal_depthwise_conv1d(shifted, weight, bias)[..., :7], got[..., :7].detach()
    )


def test_bad_shapes_are_refused() -> None:
    x = torch.zeros(1, 4, 3, 2)
    B = C = torch.zeros(1, 4, 2, 1)  # 2 groups do not divide 3 heads
    with pytest.raises(ValueError, match="incompatible shapes"):
        ssd_chunked_scan(x, torch.zeros(1, 4, 3), torch.zeros(3), B, C, 4)
