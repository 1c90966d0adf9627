"""``MLAModelProvider``: megatron-core's GPT model with multi-latent attention (DeepSeek-V3).

megatron-core 0.19 implements multi-latent attention itself (``MLASelfAttention`` with the
fields of ``MLATransformerConfig``: low-rank query and shared key/value latents with their
norms, decoupled RoPE channels in DeepSeek's interleaved pair layout, plain or YaRN RoPE
through ``rope_type``). This provider is that config plus :class:`GPTModelProvider`'s
building. The layers are megatron's local spec (``qk_layernorm`` gives the two latent
norms); on CPU the core attention is the portable SDPA attention (query/key heads wider than
value heads), on CUDA megatron's ``DotProductAttention``. Transformer Engine's spec is
refused: it fuses the latent norms into the up projections under other parameter names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from megatron.core.transformer.transformer_config import MLATransformerConfig

from bridge.train.models.gpt_provider import GPTModelProvider
from core_utils import cpu_cuda_compat

__all__ = ["MLAModelProvider"]


@dataclass
class MLAModelProvider(GPTModelProvider, MLATransformerConfig):
    """A :class:`GPTModelProvider` with multi-latent attention (see the module docstring).

    Every field of megatron's ``MLATransformerConfig`` can be set (``q_lora_rank``,
    ``kv_lora_rank``, ``qk_head_dim``, ``qk_pos_emb_head_dim``, ``v_head_dim``, ``rope_type``
    and the YaRN fields); ``qk_layernorm`` (the latent norms) defaults to on.
    """

    multi_latent_attention: bool = True
    qk_layernorm: bool = True
    position_embedding_type: Literal["learned_absolute", "rope", "none", "yarn"] = "rope"
    _local_modules_only: ClassVar[tuple[str, str] | None] = (
        "multi-latent attention",
        "its spec fuses the latent norms into the up projections under other names",
    )
    _fixed_fields: ClassVar[dict[str, tuple[Any, str]]] = {
        "multi_latent_attention": (True, "by MLAModelProvider (it builds multi-latent attention)"),
        "position_embedding_type": ("rope", "with multi-latent attention (its RoPE: rope_type)"),
        "context_parallel_size": (1, "by this provider's attention"),
    }

    def __post_init__(self) -> None:
        """Refuse what megatron's local multi-latent attention cannot build, then GPT's
        and megatron's checks.

        Raises:
            ValueError: A setting naming the field (``q_lora_rank=None``, a latent width
                the tensor-parallel size does not divide, a RoPE type other than ``rope``
                and ``yarn``).
        """
        if self.q_lora_rank is None:
            # megatron-core 0.19's local spec needs a fused norm + linear layer (Transformer
            # Engine) to build the query projection without a low-rank step.
            raise ValueError(
                "model.q_lora_rank=None (queries without a low-rank projection) is not "
                "supported by megatron-core's local multi-latent attention; set q_lora_rank"
            )
        if self.rope_type not in ("rope", "yarn"):
            raise ValueError(f"model.rope_type={self.rope_type!r} is not one of 'rope', 'yarn'")
        tp = self.tensor_model_parallel_size
        for name, size in (
            ("q_lora_rank", self.q_lora_rank),
            ("kv_lora_rank + qk_pos_emb_head_dim", self.kv_lora_rank + self.qk_pos_emb_head_dim),
        ):
            if tp > 0 and size % tp:
                raise ValueError(
                    f"model.tensor_model_parallel_size={tp} does not divide model.{name}="
                    f"{size} (megatron splits the down projections' outputs over the "
                    "tensor-parallel ranks); change one of them"
                )
        super().__post_init__()

    def _build_model(self, vp_stage: int | None, **common: Any) -> Any:
        """megatron's ``GPTModel`` (see :meth:`GPTModelProvider.provide`).

        megatron's multi-latent attention creates its rotary embedding on
        ``torch.cuda.current_device()``; without CUDA it is built with the CPU as that
        device (``core_utils.cpu_cuda_compat``) and kept there.
        """
        with cpu_cuda_compat():  # a no-op with CUDA
            return super()._build_model(vp_stage, **common)
