"""Text generation from bridge-train checkpoints on megatron-core's inference machinery.

* :func:`load_generation_model`: any bridge-train checkpoint (pretrained, finetuned, LoRA
  adapters merged on the fly, imported from Hugging Face) with the tokenizer it was trained
  with, on the trainer's megatron engine.
* :class:`TextGenerator`: batched prompts of different lengths through megatron-core's text
  generation controller and KV cache; greedy or sampled, stop strings, streaming.
* ``bridge-generate`` (:mod:`bridge.train.generate.cli`): the command.

Importing this package imports neither torch nor megatron-core (``bridge-generate --help``
stays fast); the names load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bridge.train._lazy_exports import lazy_exports

if TYPE_CHECKING:
    from bridge.train.generate.errors import GenerationError as GenerationError
    from bridge.train.generate.generator import (
        Completion as Completion,
        TextGenerator as TextGenerator,
    )
    from bridge.train.generate.loading import (
        GenerationModel as GenerationModel,
        load_generation_model as load_generation_model,
    )
    from bridge.train.generate.options import SamplingOptions as SamplingOptions

# The TYPE_CHECKING block above is the one table of the exports (name -> module).
__all__ = sorted(lazy_exports(globals()))
