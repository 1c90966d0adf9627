"""Built-in recipes of the ``bridge-train`` command (YAML files shipped with the package).

:data:`RECIPES` lists them, each with its one-line summary (``bridge-train --help`` shows
them). ``bridge-train --recipe NAME [overrides]`` runs one; :func:`recipe_path` gives its
file, which you can copy and edit (``bridge-train --config my_recipe.yaml``).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["DEFAULT_RECIPE", "RECIPES", "recipe_path"]


#: What ``--recipe`` takes -> its one line for ``bridge-train --help``; the file inside
#: ``bridge.train.recipes`` is ``<name>.yaml``.
RECIPES: dict[str, str] = {
    "tiny_gpt": "4-layer GPT on mock data, CPU, about a minute",
    "text_corpus": (
        "small GPT on a local text corpus (byte-level tokenizer; set dataset.blend to the "
        "prefix written by bridge-preprocess-data)"
    ),
    "tiny_hybrid": "4-layer hybrid Mamba model (pattern M*M-) on mock data, CPU, about a minute",
    "tiny_t5": (
        "T5 encoder-decoder (2 + 2 layers) on generated span-corruption data, CPU, about a minute"
    ),
    "sft": (
        "supervised finetuning on a JSONL prompt/answer task (examples/data/sft_addition), "
        "answer-only loss"
    ),
    "sft_lora": (
        "the sft recipe with LoRA adapters on a frozen base (checkpoint.pretrained_checkpoint, "
        "default runs/gpt_text_corpus)"
    ),
    "mimo": (
        "vision-language MIMO model (bridge.mimo) on synthetic image-caption pairs; 1, 2 or 4 ranks"
    ),
}

DEFAULT_RECIPE = "tiny_gpt"


def recipe_path(name: str) -> Path:
    """The YAML file of the built-in recipe ``name``.

    Raises:
        KeyError: Unknown name (the message lists the recipes).
    """
    if name not in RECIPES:
        import difflib

        close = difflib.get_close_matches(name, list(RECIPES), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise KeyError(f"unknown recipe {name!r}; available: {', '.join(RECIPES)}.{hint}")
    return Path(str(resources.files(__name__).joinpath(f"{name}.yaml")))
