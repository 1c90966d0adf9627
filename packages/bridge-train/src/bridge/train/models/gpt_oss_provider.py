"""``GptOssModelProvider``: megatron-core's GPT model with YaRN RoPE fields (gpt-oss).

Everything gpt-oss computes is a megatron-core 0.19 feature (attention sinks
``softmax_type="learnable"``, the clamped SwiGLU ``activation_func=quick_gelu`` +
``activation_func_clamp_value`` + ``glu_linear_offset=1``, biased experts and router,
``window_size`` + ``window_attn_skip_freq``; docs/models.md's ``gpt_oss`` row). This provider
adds the config fields megatron's ``GPTModel`` reads for ``position_embedding_type="yarn"``
(``yarn_*``, which ``TransformerConfig`` does not declare) and settles what the features
need: the sinks are marked as split over tensor parallelism like the heads, and
``expert_tensor_parallel_size`` defaults to 1 (megatron-core supports biased experts only
without expert tensor parallelism). Transformer Engine's spec is refused (its fused norms
change the parameter names the Hugging Face mapping reads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor,
)
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

from bridge.train.models.gpt_provider import GPTModelProvider

__all__ = ["GptOssModelProvider"]


@dataclass
class GptOssModelProvider(GPTModelProvider):
    """A :class:`GPTModelProvider` with megatron's YaRN fields (see the module docstring).

    Attributes:
        yarn_rotary_scaling_factor: YaRN ``factor`` (context extension ratio); 1 means no
            scaling (required unless ``position_embedding_type="yarn"``: megatron applies
            the YaRN attention factor to every rotary embedding of a config that has it).
        yarn_original_max_position_embeddings: Context length before the extension.
        yarn_beta_fast: YaRN ``beta_fast``.
        yarn_beta_slow: YaRN ``beta_slow``.
        yarn_mscale: YaRN ``mscale`` (``None``: the attention factor is
            ``0.1 * ln(factor) + 1``).
        yarn_mscale_all_dim: YaRN ``mscale_all_dim`` (``None`` as for ``yarn_mscale``).
        yarn_correction_range_round_to_int: Round the frequency correction range to whole
            dimensions (Hugging Face's ``truncate``).
    """

    yarn_rotary_scaling_factor: float = 1.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float | None = None
    yarn_mscale_all_dim: float | None = None
    yarn_correction_range_round_to_int: bool = True
    _local_modules_only: ClassVar[tuple[str, str] | None] = (
        "gpt-oss",
        "its fused norms change the parameter names the Hugging Face mapping reads",
    )

    def __post_init__(self) -> None:
        """Settle the expert tensor-parallel size, refuse a YaRN factor without YaRN, then
        GPT's and megatron's checks.

        Raises:
            ValueError: A YaRN attention factor on a model without YaRN RoPE, or expert
                tensor parallelism with biased experts.
        """
        # (read through getattr: megatron's dataclass hierarchy leaves mypy without its type)
        if getattr(self, "expert_tensor_parallel_size", None) is None and self.add_bias_linear:
            self.expert_tensor_parallel_size = 1
        if self.position_embedding_type != "yarn":
            factor = _yarn_get_concentration_factor(
                float(self.yarn_rotary_scaling_factor), self.yarn_mscale, self.yarn_mscale_all_dim
            )
            if factor != 1.0:
                raise ValueError(
                    f"model.yarn_rotary_scaling_factor={self.yarn_rotary_scaling_factor} with "
                    f"position_embedding_type={self.position_embedding_type!r}: megatron "
                    "would scale every rotary embedding by the YaRN attention factor; set "
                    "position_embedding_type='yarn' or yarn_rotary_scaling_factor=1"
                )
        if (
            self.num_moe_experts
            and self.add_bias_linear
            and self.expert_tensor_parallel_size not in (None, 1)
        ):
            raise ValueError(
                f"model.expert_tensor_parallel_size={self.expert_tensor_parallel_size}: "
                "megatron-core supports biased experts (add_bias_linear) only without expert "
                "tensor parallelism; set it to 1"
            )
        super().__post_init__()

    def _build_model(self, vp_stage: int | None, **common: Any) -> Any:
        """megatron's ``GPTModel`` (see :meth:`GPTModelProvider.provide`); every learnable
        ``softmax_offset`` (the attention sinks) is marked as split over tensor parallelism
        along the heads, as its shape is."""
        model = super()._build_model(vp_stage, **common)
        for module in model.modules():
            offset = module._parameters.get("softmax_offset")
            if offset is not None and not getattr(offset, "tensor_model_parallel", False):
                set_tensor_model_parallel_attributes(offset, True, 0, 1)
        return model
