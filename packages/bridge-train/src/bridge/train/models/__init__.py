"""Model providers: configs that build megatron-core models.

The names are imported on first use, so importing a submodule that needs no megatron-core
(``bridge.train.models.families``, which ``bridge-convert`` reads first) stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bridge.train._lazy_exports import lazy_exports

if TYPE_CHECKING:
    from bridge.train.models.gpt_provider import (
        GPTModelProvider as GPTModelProvider,
        calculate_padded_vocab_size as calculate_padded_vocab_size,
    )
    from bridge.train.models.layer_specs import (
        LayerSpecBackend as LayerSpecBackend,
        build_gpt_layer_spec as build_gpt_layer_spec,
        resolve_layer_spec_backend as resolve_layer_spec_backend,
    )
    from bridge.train.models.mamba_provider import MambaProvider as MambaProvider
    from bridge.train.models.t5_provider import T5ModelProvider as T5ModelProvider

# The TYPE_CHECKING block above is the one table of the exports (name -> module).
__all__ = sorted(lazy_exports(globals()))
