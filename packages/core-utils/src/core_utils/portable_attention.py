"""A megatron-core core-attention module that runs on any device.

megatron-core's ``DotProductAttention`` takes its score buffer from a global memory buffer
allocated on ``torch.cuda.current_device()``, so a ``GPTModel`` built from the local layer
spec cannot run on CPU. :class:`SDPACoreAttention` computes the same attention with
``torch.nn.functional.scaled_dot_product_attention``, which every torch device supports,
and accepts the constructor and ``forward`` arguments megatron passes to a core attention.
:func:`with_sdpa_core_attention` swaps it into a layer spec.

This module needs megatron-core (``pip install megatron-core``); ``import core_utils`` does
not import it.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

try:
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig
except ImportError as exc:  # pragma: no cover - exercised only without megatron-core
    raise ImportError(
        "core_utils.portable_attention needs megatron-core: pip install megatron-core"
    ) from exc

__all__ = ["SDPACoreAttention", "with_sdpa_core_attention"]


class SDPACoreAttention(MegatronModule):
    """Core attention (softmax(QK^T * scale + mask) V) through torch SDPA.

    Tensors follow megatron's layout: query ``[sq, b, np, hn]``, key and value
    ``[sk, b, ng, hn]`` (``ng`` query groups, shared by the query heads of a group), and the
    output is ``[sq, b, np * hn]``. ``attention_mask`` follows megatron's convention: ``True``
    marks positions that must NOT be attended to (``[b, 1, sq, sk]`` or broadcastable, for
    self- and cross-attention alike). A causal ``attn_mask_type`` adds the causal mask on
    top of any given mask. ``config.window_size`` limits each query to a sliding window, on
    every layer or, with ``config.window_attn_skip_freq``, on the layers megatron's
    ``is_layer_window_attention`` names. A query row with every key masked gets the mean of the values,
    as megatron's masked softmax gives it (no NaN).

    ``config.softmax_type`` as megatron's ``DotProductAttention`` reads it: ``"vanilla"``;
    ``"off-by-one"`` (a zero logit added to every softmax denominator); ``"learnable"`` (a
    learned logit per head, the *attention sink*: ``softmax_offset`` of shape
    ``[heads on this rank]``, split over tensor parallelism like the heads). With a sink the
    probabilities are ``exp(s_j) / (exp(sink) + sum_k exp(s_k))``, computed explicitly
    (scores, the sink as one extra column, softmax, the column dropped) since SDPA has no
    such term. Query and key heads may be wider than value heads (multi-latent attention
    passes ``k_channels`` / ``v_channels``; the shapes come from the tensors).

    Args:
        config: The transformer config; ``kv_channels``, ``num_attention_heads``,
            ``num_query_groups``, ``attention_dropout`` and ``softmax_scale`` are used.
        layer_number: 1-based layer index (kept for interface compatibility).
        attn_mask_type: ``AttnMaskType.causal`` for decoders, ``padding`` / ``no_mask`` for
            bidirectional encoders.
        attention_type: Unused; accepted because megatron passes it.
        attention_dropout: Overrides ``config.attention_dropout`` when given.
        softmax_scale: Overrides ``1 / sqrt(head_dim)`` when given.
        cp_comm_type: Accepted for compatibility; context parallelism is not supported.
        pg_collection: Process groups; ``pg_collection.tp`` gives the tensor-parallel size.
        k_channels: Query/key head width (multi-latent attention); default ``kv_channels``.
        v_channels: Value head width (multi-latent attention); taken from the tensors.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(
                "SDPACoreAttention does not support context parallelism "
                f"(context_parallel_size={config.context_parallel_size}); use Transformer "
                "Engine attention on GPU or set context_parallel_size=1"
            )
        softmax_type = getattr(config, "softmax_type", "vanilla")
        if softmax_type not in ("vanilla", "off-by-one", "learnable"):
            raise ValueError(
                f"SDPACoreAttention: softmax_type={softmax_type!r} is not one of 'vanilla', "
                "'off-by-one', 'learnable'"
            )
        self.tp_group = pg_collection.tp if pg_collection is not None else None
        tp_size = pg_collection.tp.size() if pg_collection is not None else _mpu_tp_size()
        for name, value in (
            ("num_attention_heads", config.num_attention_heads),
            ("num_query_groups", config.num_query_groups),
        ):
            if value % tp_size:
                raise ValueError(
                    f"{name}={value} is not divisible by tensor_model_parallel_size={tp_size}"
                )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.heads_per_partition = config.num_attention_heads // tp_size
        self.groups_per_partition = config.num_query_groups // tp_size
        head_dim = k_channels if k_channels is not None else config.kv_channels
        if softmax_scale is None:
            softmax_scale = config.softmax_scale
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        )
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        # (left, right) tokens each query may see around its own position; -1 is unlimited.
        window = getattr(config, "window_size", None)
        skip = getattr(config, "window_attn_skip_freq", None)
        if window is not None and skip is not None:
            # Sliding windows on some layers only (megatron's rule: every skip-th layer, or
            # the 0/1 list per layer, attends to everything).
            from megatron.core.transformer.utils import is_layer_window_attention

            if not is_layer_window_attention(window, skip, self.layer_number):
                window = None
        self.window_size: tuple[int, int] | None = (
            None if window is None else (int(window[0]), int(window[1]))
        )
        # The sink logit per head (megatron's name and shape, so checkpoints and Hugging Face
        # mappings are those of DotProductAttention); a zero one for "off-by-one".
        if softmax_type == "vanilla":
            self.softmax_offset: torch.Tensor | None = None
        elif softmax_type == "off-by-one":
            self.register_buffer(
                "softmax_offset",
                torch.zeros(self.heads_per_partition, dtype=config.params_dtype),
                persistent=False,
            )
        else:  # "learnable"
            offset = torch.nn.Parameter(
                torch.empty(self.heads_per_partition, dtype=config.params_dtype)
            )
            if config.perform_initialization:
                _init_sharded_offset(offset, config, tp_size, self.tp_group)
            else:
                with torch.no_grad():
                    offset.zero_()
            # Split over tensor parallelism like the heads (megatron's attributes, read by its
            # gradient-norm and checkpoint code and by the Hugging Face weight loader).
            from megatron.core.tensor_parallel.layers import (
                set_tensor_model_parallel_attributes,
            )

            set_tensor_model_parallel_attributes(offset, True, 0, 1)
            self.softmax_offset = offset

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any | None = None,
    ) -> torch.Tensor:
        """Attend ``query`` to ``key``/``value``; returns ``[sq, b, np * hn]``."""
        if packed_seq_params is not None:
            raise NotImplementedError("SDPACoreAttention does not support packed sequences")
        if attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention does not support attention_bias")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type

        # From the tensors, not the config: cross-attention keys have one head per query
        # head even when self-attention uses grouped queries.
        grouped = query.size(2) != key.size(2)

        # [s, b, n, h] -> [b, n, s, h]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        sq, sk = q.size(2), k.size(2)
        causal = mask_type == AttnMaskType.causal
        keep: torch.Tensor | None = None
        if attention_mask is not None:
            keep = ~attention_mask.to(torch.bool)
        if self.window_size is not None:
            left, right = self.window_size
            offset = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
            distance = offset - torch.arange(sk, device=q.device)[None, :]
            band = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
            if left >= 0:
                band &= distance <= left
            if right >= 0:
                band &= -distance <= right
            keep = band if keep is None else keep & band
        if causal and keep is not None:
            keep = keep & torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
            causal = False
        if keep is not None:
            # A query that may attend to nothing (a padding position) gets the mean of all
            # values, as megatron's masked softmax (fill -10000, then softmax) gives it, and
            # no gradient through its scores; SDPA would return NaN there, which the loss
            # mask cannot remove (NaN * 0 = NaN). A zero query scores every key equally.
            empty = ~keep.any(dim=-1, keepdim=True)
            keep = keep | empty
            q = q.masked_fill(empty, 0.0)
        if self.softmax_offset is not None:
            if grouped:
                # The explicit sink path has no grouped form: repeat the KV heads.
                repeat = q.size(1) // k.size(1)
                k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
            context = self._attend_with_sink(q, k, v, keep, causal)
            b, n, _, h = context.shape
            return context.permute(2, 0, 1, 3).reshape(sq, b, n * h)
        context = torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=keep,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=causal,
            scale=self.softmax_scale,
            # SDPA maps query heads to KV groups itself (torch >= 2.5), so the KV cache is
            # not copied once per query head on every decoding step.
            enable_gqa=grouped,
        )
        # [b, n, sq, h] -> [sq, b, n * h]
        b, n, _, h = context.shape
        return context.permute(2, 0, 1, 3).reshape(sq, b, n * h)

    def _attend_with_sink(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        keep: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        """``softmax([scores, sink])`` without the sink column, times ``v`` (``[b, n, s, h]``)."""
        assert self.softmax_offset is not None
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.softmax_scale
        sq, sk = scores.shape[-2:]
        if causal:
            keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        sink = self.softmax_offset.to(scores.dtype).reshape(1, -1, 1, 1)
        logits = torch.cat([scores, sink.expand(scores.shape[0], -1, sq, 1)], dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        if self.training and self.dropout_p > 0:
            probs = torch.nn.functional.dropout(probs, p=self.dropout_p)
        return torch.matmul(probs.to(v.dtype), v)

    def sharded_state_dict(
        self,
        prefix: str = "",
        sharded_offsets: tuple[tuple[int, int, int], ...] = (),
        metadata: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The learnable sink logits split over tensor parallelism along the heads (as
        megatron's ``DotProductAttention`` maps them); nothing otherwise."""
        if not isinstance(self.softmax_offset, torch.nn.Parameter):
            return {}
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group,
            make_sharded_tensors_for_checkpoint,
        )

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        tp_group = self.tp_group
        if tp_group is None:
            from megatron.core import parallel_state

            tp_group = parallel_state.get_tensor_model_parallel_group()
        return make_sharded_tensors_for_checkpoint(
            {"softmax_offset": self.softmax_offset},
            prefix,
            {"softmax_offset": 0},
            sharded_offsets,
            tp_group=tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )


def _init_sharded_offset(
    offset: torch.nn.Parameter, config: TransformerConfig, tp_size: int, tp_group: Any
) -> None:
    """Initialise this rank's slice of the sink logits as one process would draw them all
    (``config.init_method`` on the whole vector), so every tensor-parallel size starts from
    the same model."""
    full = torch.empty(offset.numel() * tp_size, dtype=offset.dtype)
    config.init_method(full)
    rank = tp_group.rank() if tp_group is not None else _mpu_tp_rank()
    with torch.no_grad():
        offset.copy_(torch.chunk(full, tp_size)[rank])


def _mpu_tp_rank() -> int:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return int(parallel_state.get_tensor_model_parallel_rank())
    return 0


def _mpu_tp_size() -> int:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return int(parallel_state.get_tensor_model_parallel_world_size())
    return 1


def with_sdpa_core_attention(spec: ModuleSpec) -> ModuleSpec:
    """Return a copy of a transformer-layer spec whose core attention is SDPA.

    Args:
        spec: A layer spec such as ``get_gpt_layer_local_spec()``, whose
            ``submodules.self_attention.submodules.core_attention`` is replaced (and the
            cross-attention's core attention too, in an encoder-decoder decoder layer).

    Returns:
        A deep copy of ``spec``; the given spec is left unchanged.

    Raises:
        ValueError: The spec has no self-attention core attention to replace.
    """
    new_spec = copy.deepcopy(spec)
    try:
        attention = new_spec.submodules.self_attention.submodules
        attention.core_attention  # noqa: B018 - probe the attribute, raising if absent
    except AttributeError as exc:
        raise ValueError(
            "with_sdpa_core_attention expects a transformer-layer ModuleSpec with "
            "submodules.self_attention.submodules.core_attention"
        ) from exc
    attention.core_attention = SDPACoreAttention
    cross = getattr(new_spec.submodules, "cross_attention", None)
    cross_submodules = getattr(cross, "submodules", None)
    if cross_submodules is not None and hasattr(cross_submodules, "core_attention"):
        cross_submodules.core_attention = SDPACoreAttention
    return new_spec
