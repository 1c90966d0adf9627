"""``qwen3``: Llama with QK-norm (an RMSNorm over each head's query and key, before RoPE).

The norms are megatron-core's ``q_layernorm`` / ``k_layernorm`` (``qk_layernorm=True``,
torch's RMSNorm over ``head_dim``). No biases. Refused: ``attention_bias: true`` (Qwen3
then biases the output projection too, and megatron-core biases the MLP with it) and
sliding windows (``use_sliding_window``, ``layer_types`` other than full attention).
"""

from __future__ import annotations

from typing import Any

from bridge.train.models.families.base import register_family
from bridge.train.models.families.config_fields import refuse
from bridge.train.models.families.llama import LlamaFamily
from bridge.train.models.families.qwen2 import refuse_sliding_windows

__all__ = ["Qwen3Family"]


@register_family
class Qwen3Family(LlamaFamily):
    """Qwen3 (see the module docstring)."""

    model_types = ("qwen3",)
    architecture = "Qwen3ForCausalLM"

    def attention_kwargs(self, config: dict[str, Any]) -> dict[str, Any]:
        """QK-norm, no biases, no sliding windows (Qwen3 and Qwen3-MoE)."""
        refuse_sliding_windows(config)
        if config.get("attention_bias"):
            raise refuse(
                config,
                "attention_bias",
                True,
                "a bias on Q, K, V and the output projection without one on the MLP is not "
                "expressible in megatron-core (add_bias_linear covers both)",
            )
        return {"qk_layernorm": True}

    def hf_extra(self, provider: Any) -> dict[str, Any]:
        """No bias, no sliding window."""
        return {"attention_bias": False, "use_sliding_window": False}
