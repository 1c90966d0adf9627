"""``mistral``: Llama with sliding-window attention on every layer.

``sliding_window`` (when set) becomes megatron's ``window_size=(sliding_window - 1, 0)``:
Hugging Face attends to the ``sliding_window`` newest keys including the query's own
position.
"""

from __future__ import annotations

from typing import Any

from bridge.train.models.families.base import register_family
from bridge.train.models.families.llama import LlamaFamily

__all__ = ["MistralFamily", "hf_sliding_window", "sliding_window_kwargs"]


def sliding_window_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """``window_size`` for a ``sliding_window`` on every layer (none when unset)."""
    window = config.get("sliding_window")
    return {} if window is None else {"window_size": (int(window) - 1, 0)}


def hf_sliding_window(provider: Any) -> int | None:
    """The ``sliding_window`` of a provider whose every layer has the same causal window."""
    window = provider.window_size
    if window is None:
        return None
    return int(window[0]) + 1


@register_family
class MistralFamily(LlamaFamily):
    """Mistral (see the module docstring)."""

    model_types = ("mistral",)
    architecture = "MistralForCausalLM"

    def attention_kwargs(self, config: dict[str, Any]) -> dict[str, Any]:
        """No biases; a sliding window on every layer when ``sliding_window`` is set."""
        return sliding_window_kwargs(config)

    def hf_extra(self, provider: Any) -> dict[str, Any]:
        """``sliding_window`` from ``window_size``."""
        return {"sliding_window": hf_sliding_window(provider)}
