"""The tokenizer interface megatron-core's T5 dataset reads, on any of the trainer's tokenizers.

megatron's ``T5MaskedWordPieceDataset`` (and its masked-LM base) needs more than the GPT
datasets: ``additional_special_tokens_ids`` (the sentinels that replace corrupted spans),
``bos`` / ``eos`` (decoder start and end), ``cls`` / ``sep`` (never masked), ``mask`` and
``inv_vocab`` (id -> token string; a piece starting with ``##`` continues a word, which
whole-word masking keeps together). :class:`T5Tokenizer` adds these to a trainer tokenizer:

* sentinels ``<extra_id_0>`` ... ``<extra_id_{N-1}>``, N = ``tokenizer.vocab_extra_ids``;
* ``<bos>``, ``<cls>``, ``<sep>``, ``<mask>``;
* ``eos`` is the tokenizer's end-of-document id (the token preprocessing writes after every
  document), ``pad`` the tokenizer's pad id (a new ``<pad>`` when it has none).

A token the base tokenizer already has (a byte-level special token, or one a Hugging Face,
GPT-2, SentencePiece or tiktoken vocabulary gives as a single id, e.g. the ``<extra_id_N>``
that ``vocab_extra_ids`` adds to it) keeps its id; the others get new ids after the base
vocabulary, so data written by ``bridge-preprocess-data`` with the base tokenizer is read
unchanged. ``vocab_size`` counts the added ids, and the model's vocabulary follows it.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

from bridge.train.data.tokenizers import ByteLevelTokenizer, Tokenizer, added_tokens

__all__ = ["T5Tokenizer"]

# In the order of the attributes bos, cls, sep and mask (and of the ids they get).
_ROLE_TOKENS = ("<bos>", "<cls>", "<sep>", "<mask>")


def _existing_id(base: Tokenizer, token: str) -> int | None:
    """The id ``base`` gives ``token`` as one token, or None."""
    if isinstance(base, ByteLevelTokenizer):
        try:
            return base.special_token_id(token)
        except KeyError:
            return None
    try:
        ids = base.tokenize(token)
    except (ValueError, TypeError):  # the null tokenizer parses integers only
        return None
    if len(ids) == 1 and 0 <= int(ids[0]) < base.vocab_size:
        return int(ids[0])
    return None


class T5Tokenizer(Tokenizer):
    """A trainer tokenizer with the sentinel and special tokens of T5 span corruption.

    Args:
        base: The tokenizer the data was written with.
        num_sentinels: Number of sentinel tokens (``tokenizer.vocab_extra_ids``).

    Attributes:
        eos: End of the decoder target: the base tokenizer's end-of-document id.
        bos: Decoder start token.
        cls: ``<cls>`` (never masked).
        sep: ``<sep>`` (never masked).
        mask: ``<mask>``.
        additional_special_tokens_ids: Sentinel ids, in the order spans take them
            (``<extra_id_0>`` first).

    Raises:
        ValueError: ``num_sentinels`` < 1.
    """

    def __init__(self, base: Tokenizer, num_sentinels: int) -> None:
        if int(num_sentinels) < 1:
            raise ValueError(
                "tokenizer.vocab_extra_ids must be >= 1 for T5 data (the sentinel tokens), got "
                f"{num_sentinels!r}"
            )
        self.base = base
        next_id = int(base.vocab_size)
        self._added: dict[int, str] = {}

        def token_id(token: str) -> int:
            nonlocal next_id
            found = _existing_id(base, token)
            if found is not None:
                return found
            self._added[next_id] = token
            next_id += 1
            return next_id - 1

        sentinels = [token_id(t) for t in added_tokens(None, int(num_sentinels))]
        self.additional_special_tokens_ids: list[int] = sentinels
        self.bos, self.cls, self.sep, self.mask = (token_id(t) for t in _ROLE_TOKENS)
        self.eod = self.eos = int(base.eod)
        base_pad = int(base.pad)
        self.pad = base_pad if base_pad >= 0 else token_id("<pad>")
        self.vocab_size = next_id
        super().__init__(base=dict(base.unique_identifiers), num_sentinels=int(num_sentinels))

    @functools.cached_property
    def inv_vocab(self) -> dict[int, str]:
        """Id -> token string for every id (built on first use)."""
        inner = getattr(self.base, "_tokenizer", None)
        id_to_token = getattr(inner, "id_to_token", None)  # Hugging Face tokenizers
        table: dict[int, str] = {}
        for i in range(int(self.base.vocab_size)):
            piece = id_to_token(i) if callable(id_to_token) else None
            table[i] = piece if isinstance(piece, str) else self.base.detokenize([i])
        return table | self._added

    def tokenize(self, text: str) -> list[int]:
        """The base tokenizer's ids (added tokens are not parsed from text)."""
        return self.base.tokenize(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Decode, writing added tokens by name."""
        out: list[str] = []
        for added, run in itertools.groupby(map(int, ids), lambda i: i in self._added):
            pieces = list(run)
            out += [self._added[i] for i in pieces] if added else [self.base.detokenize(pieces)]
        return "".join(out)
