"""``Gemma3ModelProvider``: megatron-core's GPT model with the pieces Gemma 3 adds.

megatron-core 0.19 builds most of Gemma 3 itself: GeGLU (``gated_linear_unit`` with the
tanh GELU), grouped-query attention with QK-norm (``qk_layernorm``), sliding windows on
some layers (``window_size`` + ``window_attn_skip_freq``), the attention scale
(``softmax_scale``), tied embeddings. What it lacks is the smallest module that plugs into
its layer spec, each described in its class (the model stays a megatron ``GPTModel``):
:class:`ZeroCenteredRMSNorm` (every norm; megatron implements
``layernorm_zero_centered_gamma`` only in Transformer Engine), :class:`PostNormResidualAdd`
(the post-attention and post-MLP norms), :class:`LocalRopeSelfAttention` (the
sliding-window layers' RoPE base), and embeddings scaled by ``sqrt(hidden_size)`` (a forward
hook, in the embedding's dtype as Gemma computes it).

The layers use megatron's local modules; on CPU the core attention is the portable SDPA
attention, on CUDA megatron's ``DotProductAttention`` (``layer_spec_backend``
``"transformer_engine"`` is refused: its fused norms would replace these modules).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.utils import is_layer_window_attention

from bridge.train.models.gpt_provider import GPTModelProvider
from core_utils.portable_attention import with_sdpa_core_attention

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

__all__ = [
    "Gemma3ModelProvider",
    "LocalRopeSelfAttention",
    "PostNormResidualAdd",
    "ZeroCenteredRMSNorm",
]


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm with a zero-centred gain: ``x / sqrt(mean(x^2) + eps) * (1 + weight)``.

    Computed in float32 and cast back to the input's dtype, as Gemma computes it. Accepts
    the arguments megatron's layer specs pass to a norm.

    Args:
        config: The transformer config (unused beyond megatron's interface).
        hidden_size: Size of the normalised (last) dimension.
        eps: Added to the mean square.
    """

    def __init__(
        self,
        config: TransformerConfig | None = None,
        hidden_size: int = 0,
        eps: float = 1e-6,
        **_: Any,
    ):
        super().__init__()
        if getattr(config, "sequence_parallel", False):
            raise ValueError(
                "model.sequence_parallel=True is not supported by Gemma 3's norms; set it to false"
            )
        self.eps = float(eps)
        self.weight = torch.nn.Parameter(torch.zeros(int(hidden_size)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The normalised ``x``."""
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return (hidden * (1.0 + self.weight.float())).type_as(x)


class PostNormResidualAdd(torch.nn.Module):
    """megatron's bias-dropout-add with the sub-layer's output normed first.

    Used as a transformer layer's ``self_attn_bda`` / ``mlp_bda``: the layer calls
    ``module(training, fused)`` and applies the returned function to
    ``(output, bias), residual, dropout probability``.

    Args:
        hidden_size: Hidden size of the model.
        eps: The norm's epsilon.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.norm = ZeroCenteredRMSNorm(None, hidden_size, eps)

    def forward(self, training: bool, fused: bool) -> Callable[..., torch.Tensor]:
        """The function the layer applies (megatron's unfused bias-dropout-add)."""
        add = get_bias_dropout_add(training, False)

        def norm_then_add(
            output_and_bias: tuple[torch.Tensor, torch.Tensor | None],
            residual: torch.Tensor,
            prob: float,
        ) -> torch.Tensor:
            output, bias = output_and_bias
            if bias is not None:
                raise ValueError("Gemma 3 layers have no biases (add_bias_linear=False)")
            return add((self.norm(output), None), residual, prob)

        return norm_then_add


class LocalRopeSelfAttention(SelfAttention):
    """megatron's ``SelfAttention``; on a sliding-window layer its queries and keys rotate
    with ``config.rotary_base_local`` (default RoPE, no scaling) instead of the model's."""

    def __init__(self, config: TransformerConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.local_rotary: Any = None
        if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, self.layer_number
        ):
            self.local_rotary = RotaryEmbedding(
                kv_channels=config.kv_channels,
                rotary_percent=config.rotary_percent,
                rotary_base=config.rotary_base_local,
                use_cpu_initialization=config.use_cpu_initialization,
            )

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """megatron's forward, with this layer's rotary embedding on window layers."""
        if self.local_rotary is not None:
            emb = kwargs.get("rotary_pos_emb")
            if emb is None:
                raise NotImplementedError(
                    "Gemma 3's local RoPE needs the model's rotary embedding tensor (flash "
                    "decoding passes cos/sin instead and is not supported)"
                )
            length = (emb[0] if isinstance(emb, tuple) else emb).shape[0]
            local = self.local_rotary(length)
            kwargs["rotary_pos_emb"] = (local, local)
        return super().forward(hidden_states, *args, **kwargs)


@dataclass
class Gemma3ModelProvider(GPTModelProvider):
    """A :class:`GPTModelProvider` for Gemma 3 text models (see the module docstring).

    Attributes:
        rotary_base_local: RoPE base of the sliding-window layers (``window_size`` with
            ``window_attn_skip_freq`` says which layers those are).
        scale_embeddings: Multiply the word embeddings by ``sqrt(hidden_size)``.
    """

    rotary_base_local: int = 10000
    scale_embeddings: bool = True
    layernorm_zero_centered_gamma: bool = True
    add_bias_linear: bool = False
    _local_modules_only: ClassVar[tuple[str, str] | None] = (
        "Gemma 3",
        "its zero-centred and post-layer norms are megatron local modules",
    )
    _fixed_fields: ClassVar[dict[str, tuple[Any, str]]] = {
        "context_parallel_size": (1, "by Gemma 3's local RoPE layers"),
        "add_bias_linear": (False, "by Gemma 3 (its layers have no biases)"),
    }

    def _default_layer_spec(self, vp_stage: int | None) -> TransformerBlockSubmodules:
        """The block spec of a Gemma 3 decoder (see the module docstring)."""
        layer = copy.deepcopy(get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"))
        sub = layer.submodules
        sub.input_layernorm = ZeroCenteredRMSNorm
        sub.pre_mlp_layernorm = ZeroCenteredRMSNorm
        attention = sub.self_attention
        attention.module = LocalRopeSelfAttention
        attention.submodules.q_layernorm = ZeroCenteredRMSNorm
        attention.submodules.k_layernorm = ZeroCenteredRMSNorm
        norm = {"hidden_size": self.hidden_size, "eps": self.layernorm_epsilon}
        sub.self_attn_bda = ModuleSpec(module=PostNormResidualAdd, params=dict(norm))
        sub.mlp_bda = ModuleSpec(module=PostNormResidualAdd, params=dict(norm))
        sub.sharded_state_dict_keys_map = {}  # the norms are not fused into the linear layers
        if self.resolved_layer_spec_backend() == "portable":
            layer = with_sdpa_core_attention(layer)
        return TransformerBlockSubmodules(
            layer_specs=[layer] * get_num_layers_to_build(self, vp_stage=vp_stage),
            layer_norm=ZeroCenteredRMSNorm,
        )

    def _build_model(self, vp_stage: int | None, **common: Any) -> Any:
        """megatron's ``GPTModel`` (see :meth:`GPTModelProvider.provide`) with scaled
        embeddings."""
        model = super()._build_model(vp_stage, **common)
        if self.scale_embeddings and common["pre_process"]:
            scale = torch.tensor(float(self.hidden_size) ** 0.5, dtype=torch.float32)
            model.embedding.word_embeddings.register_forward_hook(
                lambda module, args, output: output * scale.to(output.dtype)
            )
        return model
