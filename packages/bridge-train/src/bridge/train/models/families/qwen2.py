"""``qwen2`` (Qwen2, Qwen2.5): Llama with a bias on the query, key and value projections.

Refused: ``use_sliding_window: true`` (Hugging Face then uses windows only on the layers
from ``max_window_layers`` on).
"""

from __future__ import annotations

from typing import Any

from bridge.train.models.families.base import register_family
from bridge.train.models.families.config_fields import refuse
from bridge.train.models.families.llama import LlamaFamily

__all__ = ["Qwen2Family", "refuse_sliding_windows"]


def refuse_sliding_windows(config: dict[str, Any]) -> None:
    """Refuse the Qwen configs' optional sliding windows (on some layers only)."""
    if config.get("use_sliding_window"):
        raise refuse(
            config,
            "use_sliding_window",
            True,
            "Hugging Face then uses sliding windows on the layers from max_window_layers on, "
            "which is not implemented; set it to false if the model was trained without it",
        )
    kinds = set(config.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise refuse(
            config,
            "layer_types",
            sorted(kinds),
            "only 'full_attention' layers are implemented for this family",
        )


@register_family
class Qwen2Family(LlamaFamily):
    """Qwen2 (see the module docstring)."""

    model_types = ("qwen2",)
    architecture = "Qwen2ForCausalLM"

    def attention_kwargs(self, config: dict[str, Any]) -> dict[str, Any]:
        """A bias on Q, K and V only; no sliding windows."""
        refuse_sliding_windows(config)
        return {"add_qkv_bias": True}

    def hf_extra(self, provider: Any) -> dict[str, Any]:
        """Qwen2 configs name no bias field (Q, K, V always have one)."""
        return {"use_sliding_window": False}
