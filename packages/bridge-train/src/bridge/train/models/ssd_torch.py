"""Mamba-2 state-space duality (SSD) scan and the short causal convolution in plain torch.

megatron-core 0.19's ``MambaMixer`` is the Mamba-2 mixer: its training path calls the
``mamba_ssm`` Triton kernel ``mamba_split_conv1d_scan_combined`` (depthwise causal
convolution, SiLU, the SSD scan with a scalar decay per head, the ``D`` skip and the
``silu(z)`` gate). Those kernels need CUDA. The functions here compute the same thing with
torch operations on any device, so hybrid models build and train on CPU.

The scan is the chunked form of SSD: inside each chunk of ``chunk_size`` positions the
output is a masked (causal) matrix product, between chunks the state is carried by a short
recurrence over chunk boundaries. Memory grows with ``seq_length x chunk_size`` instead of
``seq_length**2``; the result equals the sequential recurrence

.. code-block:: text

    h_t = exp(dt_t * A) * h_{t-1} + dt_t * x_t B_t^T          (per head: [headdim, d_state])
    y_t = h_t C_t + D * x_t
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_depthwise_conv1d", "ssd_chunked_scan"]


def causal_depthwise_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Depthwise causal 1-D convolution (what ``causal_conv1d_fn`` computes, no activation).

    Args:
        x: ``[batch, channels, seq]``.
        weight: ``[channels, 1, width]`` (megatron's ``conv1d_weight``).
        bias: ``[channels]`` or ``None``.

    Returns:
        ``[batch, channels, seq]``; position ``t`` sees inputs ``t - width + 1 .. t``.
    """
    width = weight.size(-1)
    out = F.conv1d(x, weight, bias, padding=width - 1, groups=x.size(1))
    return out[..., : x.size(-1)]


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = a[..., j+1] + ... + a[..., i]`` for ``j <= i``, ``-inf`` above.

    Built by a masked cumulative sum rather than a difference of cumulative sums, so long
    chunks do not lose precision to cancellation.
    """
    length = a.size(-1)
    expanded = a.unsqueeze(-1).expand(*a.shape, length)  # [..., i, j] = a_i
    strictly_below = torch.ones(length, length, dtype=torch.bool, device=a.device).tril(-1)
    sums = expanded.masked_fill(~strictly_below, 0.0).cumsum(dim=-2)
    causal = torch.ones(length, length, dtype=torch.bool, device=a.device).tril(0)
    return sums.masked_fill(~causal, float("-inf"))


def ssd_chunked_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Mamba-2 SSD scan (no initial state), differentiable, on any device.

    Args:
        x: ``[batch, seq, heads, headdim]``.
        dt: ``[batch, seq, heads]``, already passed through softplus (positive step sizes).
        A: ``[heads]``, negative decay rates.
        B: ``[batch, seq, groups, d_state]``; ``heads`` must be a multiple of ``groups``
            (consecutive heads share a group, as in megatron's mixer).
        C: ``[batch, seq, groups, d_state]``.
        chunk_size: Positions per chunk (megatron's ``chunk_size``, 128 by default).
        D: Skip weight ``[heads]`` or ``[heads, headdim]``, or ``None``.

    Returns:
        ``y`` of shape ``[batch, seq, heads, headdim]`` in ``x``'s dtype (computed in fp32, or
        fp64 for fp64 inputs).

    Raises:
        ValueError: Shapes do not fit together or ``chunk_size`` is not positive.
    """
    batch, seq, heads, _ = x.shape
    groups = B.size(2)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if heads % groups or C.shape != B.shape or dt.shape != (batch, seq, heads):
        raise ValueError(
            f"ssd_chunked_scan: incompatible shapes x={tuple(x.shape)} dt={tuple(dt.shape)} "
            f"B={tuple(B.shape)} C={tuple(C.shape)}"
        )
    out_dtype = x.dtype
    # fp32 at least (bf16/fp16 inputs lose too much in the exponentials), fp64 stays fp64.
    compute = torch.promote_types(x.dtype, torch.float32)
    x, dt, A, B, C = (t.to(compute) for t in (x, dt, A, B, C))
    B, C = (t.repeat_interleave(heads // groups, dim=2) for t in (B, C))

    chunk = min(chunk_size, seq)
    pad = (-seq) % chunk
    if pad:
        # Zero step sizes at the end: no decay, no input, and causality keeps them from
        # touching the real positions before them.
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        dt = F.pad(dt, (0, 0, 0, pad))
    n_chunks = (seq + pad) // chunk

    def chunked(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(batch, n_chunks, chunk, *t.shape[2:])

    x_dt = chunked(x * dt.unsqueeze(-1))  # [b, c, l, h, p]
    B, C = chunked(B), chunked(C)  # [b, c, l, h, n]
    decay = chunked(dt * A).permute(0, 3, 1, 2)  # [b, h, c, l]
    decay_cumsum = decay.cumsum(dim=-1)

    # Within a chunk: causal "attention" C_t.B_s weighted by the decay from s to t.
    within = torch.exp(_segment_sums(decay))  # [b, h, c, l, s]
    y = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", C, B, within, x_dt)

    # State each chunk leaves behind from its own inputs.
    to_chunk_end = torch.exp(decay_cumsum[..., -1:] - decay_cumsum)  # [b, h, c, l]
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, to_chunk_end, x_dt)

    # Carry states across chunk boundaries (state entering chunk 0 is zero).
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    chunk_decay = torch.exp(_segment_sums(F.pad(decay_cumsum[..., -1], (1, 0))))
    states = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)[:, :-1]

    # What the carried-in state contributes at every position of its chunk.
    from_chunk_start = torch.exp(decay_cumsum)  # [b, h, c, l]
    y = y + torch.einsum("bclhn,bchpn,bhcl->bclhp", C, states, from_chunk_start)

    y = y.reshape(batch, n_chunks * chunk, heads, -1)[:, :seq]
    if D is not None:
        skip = D.to(compute)
        skip = skip.view(heads, 1) if skip.dim() == 1 else skip
        y = y + x[:, :seq] * skip
    return y.to(out_dtype)
