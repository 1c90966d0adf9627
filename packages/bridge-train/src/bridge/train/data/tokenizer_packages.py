"""The optional package each tokenizer type needs, and the bridge-train extra installing it.

Import-light (no torch, no megatron-core) so that the configuration checks can refuse a
tokenizer that cannot be built before anything heavy starts.
"""

from __future__ import annotations

import importlib.util

__all__ = ["TOKENIZER_EXTRAS", "missing_tokenizer_package", "require_tokenizer_package"]

#: ``tokenizer_type`` -> (importable module, bridge-train extra), or None when it needs none.
TOKENIZER_EXTRAS: dict[str, tuple[str, str] | None] = {
    "NullTokenizer": None,
    "ByteLevelTokenizer": None,
    "HuggingFaceTokenizer": ("tokenizers", "hf"),
    "GPT2BPETokenizer": ("tokenizers", "hf"),
    "SentencePieceTokenizer": ("sentencepiece", "sentencepiece"),
    "TikTokenizer": ("tiktoken", "tiktoken"),
}


def missing_tokenizer_package(tokenizer_type: str) -> str | None:
    """Why ``tokenizer_type`` cannot be built here, or None when its package is installed.

    Args:
        tokenizer_type: A ``tokenizer.tokenizer_type`` value.

    Returns:
        One line naming the missing package and the ``pip install`` of the extra, or None
        (also for types that need no optional package).
    """
    needs = TOKENIZER_EXTRAS.get(tokenizer_type)
    if needs is None:
        return None
    module, extra = needs
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or half-removed installation
        found = False
    if found:
        return None
    # uv sync keeps exactly what it is given: --inexact leaves the other extras installed.
    return (
        f"{tokenizer_type!r} needs the {module!r} package, which is not installed; "
        f"pip install 'bridge-train[{extra}]' (in a clone of this repository: "
        f"uv sync --inexact --extra {extra})"
    )


def require_tokenizer_package(tokenizer_type: str) -> None:
    """Raise :func:`missing_tokenizer_package`'s line as an ``ImportError`` when it has one."""
    message = missing_tokenizer_package(tokenizer_type)
    if message is not None:
        raise ImportError(message)
