"""``mistral``: Llama with sliding-window attention on every layer.

``sliding_window`` (when set) becomes megatron's ``window_size=(sliding_window - 1, 0)``:
Hugging Face attends to the ``sliding_window`` newest keys including the query's own
position.
"""

from __future__ import annotations

from typing import Any

from bridge.train.models.families.base import register_family
from bridge.train.models.families.llama import LlamaFamily

__all__ = ["MistralFamily"]


@register_family
class MistralFamily(LlamaFamily):
    """Mistral (see the module docstring)."""

    model_types = ("mistral",)
    architecture = "MistralForCausalLM"

    def attention_kwargs(self, config: dict[str, Any]) -> dict[str, Any]:
        """No biases; a sliding window on every layer when ``sliding_window`` is set."""
        window = config.get("sliding_window")
        return {} if window is None else {"window_size": (int(window) - 1, 0)}

    def hf_extra(self, provider: Any) -> dict[str, Any]:
        """``sliding_window`` from ``window_size`` (the same causal window on every layer)."""
        window = provider.window_size
        return {"sliding_window": None if window is None else int(window[0]) + 1}
