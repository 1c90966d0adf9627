"""The tokenizer section: which tokenizer the trainer builds and its vocabulary."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from bridge.config._checks import at_least
from bridge.config._codec import normalize_fields
from bridge.config._errors import field_error
from bridge.config._protocols import TokenizerConfigProtocol
from bridge.config._section import config_section

TokenizerType = Literal[
    "NullTokenizer",
    "ByteLevelTokenizer",
    "HuggingFaceTokenizer",
    "SentencePieceTokenizer",
    "GPT2BPETokenizer",
    "TikTokenizer",
]

_BYTE_VOCAB = 256
# Special tokens the byte-level tokenizer always has (end of document, padding).
_BYTE_LEVEL_SPECIALS = ("<eod>", "<pad>")

#: What each tokenizer type cannot be built without (the section checks it; the trainer's
#: ``build_tokenizer`` checks the same for a config given to it directly).
TOKENIZER_REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    "NullTokenizer": ("vocab_size",),
    "HuggingFaceTokenizer": ("tokenizer_model",),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "TikTokenizer": ("tokenizer_model",),
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
}


@config_section
@dataclass(kw_only=True)
class TokenizerConfig:
    """Configuration of the tokenizer the trainer builds for datasets and the model."""

    tokenizer_type: TokenizerType | None = None
    """Which tokenizer to build. ``"NullTokenizer"`` (ids only, for mock data; needs
    ``vocab_size``), ``"ByteLevelTokenizer"`` (UTF-8 bytes, 256 ids plus special tokens),
    ``"HuggingFaceTokenizer"`` / ``"SentencePieceTokenizer"`` / ``"TikTokenizer"`` (need
    ``tokenizer_model``), ``"GPT2BPETokenizer"`` (needs ``vocab_file`` and ``merge_file``).
    Unset: no tokenizer is configured."""

    tokenizer_model: str | None = None
    """Tokenizer model, a local path: a SentencePiece ``.model`` file, a tiktoken vocabulary
    (megatron-core's ``.json`` list of ranks) or a Hugging Face directory holding
    ``tokenizer.json``. Nothing is downloaded."""

    vocab_file: str | None = None
    """Vocabulary file (GPT-2 BPE ``vocab.json``)."""

    merge_file: str | None = None
    """BPE merges file (GPT-2 BPE ``merges.txt``)."""

    vocab_size: int | None = None
    """Number of token ids. Required for ``NullTokenizer``; for ``ByteLevelTokenizer`` at
    least 256 plus its special tokens and extra ids (258 by default: ``<eod>``, ``<pad>``),
    which is also its size when unset; for file-based tokenizers it is read from the files
    when unset."""

    vocab_extra_ids: int = 0
    """Extra sentinel tokens appended to the vocabulary (as T5-style ``<extra_id_N>``)."""

    make_vocab_size_divisible_by: int = 128
    """Pad the embedding's vocabulary to a multiple of this value times the tensor-parallel
    size, for efficient kernels."""

    special_tokens: list[str] | None = None
    """Additional special tokens to register with the tokenizer."""

    hf_tokenizer_kwargs: dict[str, Any] | None = None
    """Extra keyword arguments for ``AutoTokenizer.from_pretrained``. bridge-train reads
    ``tokenizer.json`` with Hugging Face ``tokenizers`` (no ``transformers``) and refuses a
    run that sets this field."""

    def __post_init__(self) -> None:
        """Check the field types, the sizes and what the chosen tokenizer type needs."""
        normalize_fields(self)
        at_least(self, "vocab_size", 1)
        at_least(self, "vocab_extra_ids", 0, allow_none=False)
        at_least(self, "make_vocab_size_divisible_by", 1, allow_none=False)
        kind = self.tokenizer_type
        if kind is None:
            return
        for name in TOKENIZER_REQUIRED_FIELDS.get(kind, ()):
            if getattr(self, name) is None:
                raise field_error(
                    self, name, None, f"it is required when tokenizer_type is {kind!r}"
                )
        if kind == "ByteLevelTokenizer" and self.vocab_size is not None:
            needed = _BYTE_VOCAB + len(self._byte_level_specials()) + self.vocab_extra_ids
            if self.vocab_size < needed:
                raise field_error(
                    self,
                    "vocab_size",
                    self.vocab_size,
                    f"a byte-level tokenizer needs at least {needed} ids ({_BYTE_VOCAB} bytes, "
                    f"{len(self._byte_level_specials())} special tokens, "
                    f"{self.vocab_extra_ids} extra ids); raise it or leave it unset",
                )

    def total_vocab_size(self) -> int | None:
        """Ids the tokenizer can emit, or None if not known yet.

        For a byte-level tokenizer: the 256 byte ids, its special tokens (``<eod>`` and
        ``<pad>`` always, plus ``special_tokens``) and ``vocab_extra_ids`` sentinels, or
        ``vocab_size`` when that is set (it then already includes them). For other types:
        ``vocab_size`` plus ``vocab_extra_ids``.
        """
        return total_vocab_size(self)

    def _byte_level_specials(self) -> list[str]:
        return _byte_level_specials(self.special_tokens)

    def padded_vocab_size(self, tensor_model_parallel_size: int = 1) -> int | None:
        """The embedding size the vocabulary is padded to, or None if the vocabulary is unknown.

        Args:
            tensor_model_parallel_size: The model's tensor-parallel size; the padded size is
                a multiple of ``make_vocab_size_divisible_by`` times this.

        Returns:
            ``total_vocab_size()`` rounded up to that multiple.
        """
        total = self.total_vocab_size()
        if total is None:
            return None
        multiple = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return math.ceil(total / multiple) * multiple


def _byte_level_specials(special_tokens: list[str] | None) -> list[str]:
    specials = list(special_tokens or ())
    specials += [token for token in _BYTE_LEVEL_SPECIALS if token not in specials]
    return specials


def total_vocab_size(tokenizer: TokenizerConfig | TokenizerConfigProtocol) -> int | None:
    """Ids a tokenizer configuration can emit, or None if not known yet.

    Works on any object providing ``TokenizerConfigProtocol`` (``special_tokens`` is read
    when present); see ``TokenizerConfig.total_vocab_size``.
    """
    vocab_size = tokenizer.vocab_size
    extra_ids = tokenizer.vocab_extra_ids or 0
    if tokenizer.tokenizer_type == "ByteLevelTokenizer":
        if vocab_size is not None:
            return int(vocab_size)
        specials = _byte_level_specials(getattr(tokenizer, "special_tokens", None))
        return _BYTE_VOCAB + len(specials) + extra_ids
    if vocab_size is None:
        return None
    return int(vocab_size) + extra_ids
