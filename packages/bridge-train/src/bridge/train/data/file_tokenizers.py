"""Tokenizers read from vocabulary files: SentencePiece, tiktoken and GPT-2 BPE.

SentencePiece and tiktoken are megatron-core's own tokenizers
(``megatron.core.tokenizers.text.libraries``) behind the trainer's interface. megatron-core's
GPT-2 BPE needs ``transformers``; here it is read with Hugging Face ``tokenizers`` (a BPE
model with GPT-2's byte-level pre-tokenizer and decoder), which gives the same ids from the
same ``vocab.json`` and ``merges.txt`` without that dependency.

Each needs an optional package, installed with an extra of bridge-train
(``bridge.train.data.tokenizers.TOKENIZER_EXTRAS``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron.core.tokenizers.text.libraries.sentencepiece_tokenizer import (
    SentencePieceTokenizer as _MegatronSentencePiece,
)
from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import (
    SPECIAL_TOKENS,
    TikTokenTokenizer,
)

from bridge.train.data.tokenizers import Tokenizer, added_tokens, require_tokenizer_package

__all__ = [
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "TikTokenizer",
]

# The end-of-document token of GPT-2's vocabulary.
_GPT2_EOD = "<|endoftext|>"
# megatron-core's tiktoken tokenizer reserves this many ids for special tokens (its default,
# which tiktoken vocabularies of released models rely on).
_TIKTOKEN_SPECIAL_IDS = 1000


def _existing_file(path: str | Path, field: str, what: str) -> Path:
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(
            f"tokenizer.{field}={str(path)!r} is not a file; point it to {what}"
        )
    return file


def _reported_size(actual: int, vocab_size: int | None, extra_ids: int) -> int:
    if vocab_size is None:
        return actual
    total = int(vocab_size) + extra_ids
    if total < actual:
        raise ValueError(
            f"tokenizer.vocab_size={vocab_size} is smaller than the tokenizer's {actual} ids; "
            "raise it or leave it unset"
        )
    return total


class _MegatronLibraryTokenizer(Tokenizer):
    """A tokenizer of megatron-core's text libraries (``self._tokenizer``) behind the
    trainer's interface."""

    _tokenizer: Any

    def tokenize(self, text: str) -> list[int]:
        """Encode ``text`` (no BOS/EOS added; tiktoken turns special-token strings into
        their ids)."""
        return [int(i) for i in self._tokenizer.text_to_ids(text)]

    def detokenize(self, ids: Sequence[int]) -> str:
        """Decode ids to text."""
        return str(self._tokenizer.ids_to_text([int(i) for i in ids]))


class SentencePieceTokenizer(_MegatronLibraryTokenizer):
    """A SentencePiece ``.model`` file, read by megatron-core's SentencePiece tokenizer.

    The end-of-document id is the model's ``eos`` (``</s>`` by default); the pad id is the
    model's ``pad`` (-1 when it was trained without one, as megatron's null tokenizer).

    Args:
        path: The ``.model`` file.
        special_tokens: Tokens added after the model's pieces.
        vocab_extra_ids: Number of ``<extra_id_N>`` sentinels added after them.
        vocab_size: Total vocabulary to report (plus ``vocab_extra_ids``); by default the
            model's pieces plus the added tokens.

    Raises:
        ImportError: ``sentencepiece`` is missing (``pip install 'bridge-train[sentencepiece]'``).
        FileNotFoundError: ``path`` is not a file.
        ValueError: The model has no end-of-sentence piece, or ``vocab_size`` is too small.
    """

    def __init__(
        self,
        path: str | Path,
        special_tokens: Sequence[str] | None = None,
        vocab_extra_ids: int = 0,
        vocab_size: int | None = None,
    ) -> None:
        require_tokenizer_package("SentencePieceTokenizer")

        file = _existing_file(path, "tokenizer_model", "a SentencePiece .model file")
        extra = added_tokens(special_tokens, vocab_extra_ids)
        # megatron adds tokens after the model's pieces only in its "legacy" mode.
        self._tokenizer = _MegatronSentencePiece(
            str(file), special_tokens=extra or None, legacy=bool(extra)
        )
        self.eod = int(self._tokenizer.tokenizer.eos_id())
        if self.eod < 0:
            raise ValueError(
                f"the SentencePiece model {str(path)!r} has no end-of-sentence piece; train it "
                "with eos_id set (the default)"
            )
        self.pad = int(self._tokenizer.tokenizer.pad_id())
        self.vocab_size = _reported_size(
            int(self._tokenizer.vocab_size), vocab_size, vocab_extra_ids
        )
        super().__init__(
            path=str(file.resolve()), special_tokens=tuple(extra), vocab_size=self.vocab_size
        )


class TikTokenizer(_MegatronLibraryTokenizer):
    """A tiktoken vocabulary, read by megatron-core's TikToken tokenizer.

    The file is megatron's tiktoken JSON: a list of ``{"rank", "token_bytes" (base64),
    "token_str"}`` whose first 256 entries are the single bytes. megatron reserves the first
    1000 ids for special tokens (``<unk>``, ``<s>``, ``</s>``, ``<mask>``, ``<pad>``,
    ``<cls>``, ``<sep>``, then ``special_tokens`` and the extra ids, then fillers); the
    end-of-document id is ``</s>`` (2) and the pad id ``<pad>`` (4).

    Args:
        path: The vocabulary file (``.json``).
        special_tokens: Special tokens after megatron's seven.
        vocab_extra_ids: Number of ``<extra_id_N>`` sentinels after them.
        vocab_size: Total vocabulary (special ids included); the file is cut to fit. By
            default all of the file's entries plus the 1000 special ids.

    Raises:
        ImportError: ``tiktoken`` is missing (``pip install 'bridge-train[tiktoken]'``).
        FileNotFoundError: ``path`` is not a file.
        ValueError: The file is not a tiktoken vocabulary list, or ``vocab_size`` leaves no
            room for it.
    """

    def __init__(
        self,
        path: str | Path,
        special_tokens: Sequence[str] | None = None,
        vocab_extra_ids: int = 0,
        vocab_size: int | None = None,
    ) -> None:
        require_tokenizer_package("TikTokenizer")

        file = _existing_file(path, "tokenizer_model", "a tiktoken vocabulary (.json)")
        if file.suffix != ".json":
            raise ValueError(
                f"tokenizer.tokenizer_model={str(path)!r} is not a tiktoken vocabulary: "
                "megatron reads a .json list of {rank, token_bytes, token_str}"
            )
        try:
            entries = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(
                f"tokenizer.tokenizer_model={str(path)!r} is not valid JSON ({exc})"
            ) from None
        if not isinstance(entries, list) or len(entries) < 256:
            raise ValueError(
                f"tokenizer.tokenizer_model={str(path)!r} is not a tiktoken vocabulary: "
                "expected a JSON list of at least the 256 byte entries"
            )
        specials = [*SPECIAL_TOKENS, *added_tokens(special_tokens, vocab_extra_ids)]
        if len(specials) > _TIKTOKEN_SPECIAL_IDS:
            raise ValueError(
                f"tokenizer.special_tokens: at most {_TIKTOKEN_SPECIAL_IDS - len(SPECIAL_TOKENS)} "
                "special tokens and extra ids fit a tiktoken vocabulary"
            )
        total = vocab_size if vocab_size is not None else _TIKTOKEN_SPECIAL_IDS + len(entries)
        if not _TIKTOKEN_SPECIAL_IDS + 256 <= total <= _TIKTOKEN_SPECIAL_IDS + len(entries):
            raise ValueError(
                f"tokenizer.vocab_size={vocab_size} does not fit the tiktoken vocabulary: it "
                f"must be between {_TIKTOKEN_SPECIAL_IDS + 256} and "
                f"{_TIKTOKEN_SPECIAL_IDS + len(entries)} ({_TIKTOKEN_SPECIAL_IDS} special ids "
                f"plus the file's {len(entries)} entries); leave it unset to use them all"
            )
        try:
            self._tokenizer = TikTokenTokenizer(
                str(file),
                special_tokens=specials,
                num_special_tokens=_TIKTOKEN_SPECIAL_IDS,
                vocab_size=int(total),
            )
        except (AssertionError, KeyError, TypeError, ValueError) as exc:  # megatron asserts
            raise ValueError(
                f"tokenizer.tokenizer_model={str(path)!r} is not a valid tiktoken vocabulary "
                f"(ranks 0..N-1, the first 256 the single bytes): {exc or type(exc).__name__}"
            ) from None
        self.vocab_size = int(total)
        self.eod, self.pad = int(self._tokenizer.eod), int(self._tokenizer.pad_id)
        super().__init__(
            path=str(file.resolve()), special_tokens=tuple(specials), vocab_size=self.vocab_size
        )


class GPT2BPETokenizer(Tokenizer):
    """GPT-2 byte-level BPE from ``vocab.json`` and ``merges.txt``.

    The end-of-document and pad id is ``<|endoftext|>``, which the vocabulary must hold.

    Args:
        vocab_file: GPT-2 ``vocab.json`` (token -> id).
        merge_file: GPT-2 ``merges.txt``.
        special_tokens: Tokens added after the vocabulary.
        vocab_extra_ids: Number of ``<extra_id_N>`` sentinels added after them.
        vocab_size: Total vocabulary to report (plus ``vocab_extra_ids``); by default the
            vocabulary plus the added tokens.

    Raises:
        ImportError: ``tokenizers`` is missing (``pip install 'bridge-train[hf]'``).
        FileNotFoundError: A file is missing.
        ValueError: The files cannot be read as GPT-2 BPE, the vocabulary has no
            ``<|endoftext|>``, or ``vocab_size`` is too small.
    """

    def __init__(
        self,
        vocab_file: str | Path,
        merge_file: str | Path,
        special_tokens: Sequence[str] | None = None,
        vocab_extra_ids: int = 0,
        vocab_size: int | None = None,
    ) -> None:
        require_tokenizer_package("GPT2BPETokenizer")
        from tokenizers import Tokenizer as _HFTokenizer, decoders, models, pre_tokenizers

        vocab = _existing_file(vocab_file, "vocab_file", "GPT-2's vocab.json")
        merges = _existing_file(merge_file, "merge_file", "GPT-2's merges.txt")
        try:
            model = models.BPE.from_file(str(vocab), str(merges))
        except Exception as exc:  # the Rust library raises a plain Exception on bad files
            raise ValueError(
                f"tokenizer.vocab_file={str(vocab_file)!r} / tokenizer.merge_file="
                f"{str(merge_file)!r} are not GPT-2 BPE files: {exc}"
            ) from None
        self._tokenizer = _HFTokenizer(model)
        self._tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tokenizer.decoder = decoders.ByteLevel()
        eod = self._tokenizer.token_to_id(_GPT2_EOD)
        if eod is None:
            raise ValueError(
                f"tokenizer.vocab_file={str(vocab_file)!r} has no {_GPT2_EOD!r} token, GPT-2's "
                "end of document; add it to the vocabulary"
            )
        # Registered as special so that it is never split when it appears in text.
        extra = added_tokens(special_tokens, vocab_extra_ids)
        self._tokenizer.add_special_tokens([_GPT2_EOD, *extra])
        # GPT-2 has no pad token.
        self.eod = self.pad = int(eod)
        self.vocab_size = _reported_size(
            int(self._tokenizer.get_vocab_size(with_added_tokens=True)), vocab_size, vocab_extra_ids
        )
        super().__init__(
            vocab_file=str(vocab.resolve()),
            merge_file=str(merges.resolve()),
            special_tokens=tuple(extra),
            vocab_size=self.vocab_size,
        )

    def tokenize(self, text: str) -> list[int]:
        """Encode ``text``."""
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Decode ids to text (special tokens kept)."""
        return str(self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False))
