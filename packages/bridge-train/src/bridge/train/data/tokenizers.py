"""Tokenizers for megatron datasets: byte-level, Hugging Face (local), null, and
``build_tokenizer`` for every ``tokenizer_type`` (the file-based ones are in
``bridge.train.data.file_tokenizers``).

Each tokenizer has what megatron-core's datasets and the trainer use: ``vocab_size``,
``eod``, ``pad``, ``tokenize(text) -> list[int]``, ``detokenize(ids) -> str`` and
``unique_identifiers`` (an ordered dict describing the tokenizer; megatron hashes it into
dataset cache keys, so two different tokenizers never share a cache).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import multiprocessing
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from bridge.config import TOKENIZER_REQUIRED_FIELDS, TokenizerConfig, TokenizerConfigProtocol

__all__ = [
    "TOKENIZER_EXTRAS",
    "ByteLevelTokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
    "Tokenizer",
    "added_tokens",
    "build_tokenizer",
    "map_in_processes",
    "missing_tokenizer_package",
    "require_tokenizer_package",
]

_BYTE_IDS = 256
_DEFAULT_SPECIALS = ("<eod>", "<pad>")

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


def added_tokens(special_tokens: Sequence[str] | None, vocab_extra_ids: int) -> list[str]:
    """``special_tokens`` followed by ``vocab_extra_ids`` sentinels ``<extra_id_N>``."""
    return [*(special_tokens or ()), *(f"<extra_id_{i}>" for i in range(vocab_extra_ids))]


class Tokenizer:
    """Common interface of the trainer's tokenizers.

    A subclass sets ``vocab_size``, ``eod`` and ``pad`` in its constructor; each
    tokenizer's docstring says what they are for it.

    Attributes:
        vocab_size: Number of token ids the model must embed.
        eod: End-of-document id, appended after every document by preprocessing.
        pad: Padding id (-1 when the tokenizer has none).
        unique_identifiers: Ordered description of the tokenizer (class and settings).
    """

    vocab_size: int
    eod: int
    pad: int

    def __init__(self, **identifiers: Any) -> None:
        self.unique_identifiers: OrderedDict[str, Any] = OrderedDict(
            [("class", type(self).__name__), *identifiers.items()]
        )

    def tokenize(self, text: str) -> list[int]:
        """Encode ``text`` to ids (no EOD appended)."""
        raise NotImplementedError

    def detokenize(self, ids: Sequence[int]) -> str:
        """Decode ids to text."""
        raise NotImplementedError


class ByteLevelTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0-255, then special tokens (EOD and PAD by default).

    Needs no files. ``detokenize`` maps special ids to their names and decodes the bytes
    with replacement of invalid UTF-8.

    Args:
        special_tokens: Special tokens after the 256 byte ids; ``"<eod>"`` and ``"<pad>"``
            are added when missing. Ids follow the given order.
        vocab_extra_ids: Number of ``<extra_id_N>`` sentinel tokens appended after them.
        vocab_size: Total vocabulary to report (>= the ids above), leaving unused ids; by
            default exactly the ids above.

    Raises:
        ValueError: ``vocab_size`` is smaller than the ids needed, or a special token repeats.
    """

    def __init__(
        self,
        special_tokens: Sequence[str] | None = None,
        vocab_extra_ids: int = 0,
        vocab_size: int | None = None,
    ) -> None:
        given = list(special_tokens or ())
        missing = [token for token in _DEFAULT_SPECIALS if token not in given]
        specials = added_tokens([*given, *missing], vocab_extra_ids)
        if len(set(specials)) != len(specials):
            raise ValueError(f"tokenizer.special_tokens has duplicates: {specials}")
        self._special_ids = {token: _BYTE_IDS + i for i, token in enumerate(specials)}
        self._id_to_special = {i: t for t, i in self._special_ids.items()}
        needed = _BYTE_IDS + len(specials)
        if vocab_size is not None and vocab_size < needed:
            raise ValueError(
                f"tokenizer.vocab_size={vocab_size} is too small for the byte-level tokenizer: "
                f"it needs {needed} ids (256 bytes + {len(specials)} special tokens)"
            )
        self.vocab_size = vocab_size if vocab_size is not None else needed
        self.eod, self.pad = self._special_ids["<eod>"], self._special_ids["<pad>"]
        super().__init__(special_tokens=tuple(specials), vocab_size=self.vocab_size)

    def special_token_id(self, token: str) -> int:
        """Id of a special token.

        Raises:
            KeyError: ``token`` is not a special token of this tokenizer.
        """
        return self._special_ids[token]

    def tokenize(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Sequence[int]) -> str:
        """Decode bytes; special ids become their token strings."""
        out: list[str] = []
        # Consecutive byte ids are decoded together (a character may take several bytes).
        for is_byte, run in itertools.groupby(map(int, ids), lambda i: 0 <= i < _BYTE_IDS):
            if is_byte:
                out.append(bytes(run).decode("utf-8", errors="replace"))
            else:
                out += [self._id_to_special.get(i, f"<unk_{i}>") for i in run]
        return "".join(out)


class NullTokenizer(Tokenizer):
    """Ids only, for mock data: ``tokenize("1 2 3") == [1, 2, 3]``.

    Follows megatron-core's null tokenizer: ids ``0 .. vocab_size - 1``, the last of them
    (``vocab_size - 1``) is the end-of-document id, and there is no pad token (``pad`` is
    -1, an id no dataset contains).

    Args:
        vocab_size: Number of ids, EOD included.

    Raises:
        ValueError: ``vocab_size`` is smaller than 2.
    """

    def __init__(self, vocab_size: int) -> None:
        if vocab_size is None or int(vocab_size) < 2:
            raise ValueError(
                f"tokenizer.vocab_size must be >= 2 for the null tokenizer, got {vocab_size!r}"
            )
        self.vocab_size = int(vocab_size)
        self.eod, self.pad = self.vocab_size - 1, -1
        super().__init__(vocab_size=self.vocab_size)

    def tokenize(self, text: str) -> list[int]:
        """Parse whitespace-separated integers."""
        return [int(x) for x in text.split()]

    def detokenize(self, ids: Sequence[int]) -> str:
        """Join ids with spaces."""
        return " ".join(str(int(i)) for i in ids)


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` tokenizer loaded from a local directory.

    The directory must contain ``tokenizer.json`` (nothing is downloaded). The EOD token
    is the first of ``eos_token`` from ``tokenizer_config.json`` / ``special_tokens_map.json``,
    ``"</s>"``, ``"<|endoftext|>"``, ``"<eos>"``, ``"<|end_of_text|>"`` that exists; the
    pad token likewise from ``pad_token``, ``"<pad>"``, ``"[PAD]"``, else the EOD token.

    Args:
        path: Directory holding ``tokenizer.json``.
        special_tokens: Tokens added to the vocabulary as special tokens.
        vocab_extra_ids: Number of ``<extra_id_N>`` sentinels added.

    Raises:
        ImportError: The ``tokenizers`` package is missing (``pip install 'bridge-train[hf]'``).
        FileNotFoundError: ``path`` is not a directory with ``tokenizer.json``.
        ValueError: No end-of-document token can be found.
    """

    def __init__(
        self,
        path: str | Path,
        special_tokens: Sequence[str] | None = None,
        vocab_extra_ids: int = 0,
    ) -> None:
        require_tokenizer_package("HuggingFaceTokenizer")
        from tokenizers import Tokenizer as _HFTokenizer

        directory = Path(path)
        file = directory / "tokenizer.json"
        if not directory.is_dir():
            raise FileNotFoundError(
                f"tokenizer.tokenizer_model={str(path)!r} is not a directory; point it to a local "
                "Hugging Face tokenizer directory containing tokenizer.json"
            )
        if not file.is_file():
            raise FileNotFoundError(
                f"tokenizer.tokenizer_model={str(path)!r} has no tokenizer.json; save the "
                "tokenizer there (tokenizer.save_pretrained(dir)) or point to another directory"
            )
        self._tokenizer = _HFTokenizer.from_file(str(file))
        extra = added_tokens(special_tokens, vocab_extra_ids)
        self._tokenizer.add_special_tokens(extra)
        settings = _read_special_token_settings(directory)
        eod = self._first_token_id(
            [settings.get("eos_token"), "</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>"]
        )
        if eod is None:
            raise ValueError(
                f"the tokenizer in {str(path)!r} has no end-of-document token (eos_token, </s>, "
                "<|endoftext|>); add one with tokenizer.special_tokens"
            )
        self.eod = eod
        pad = self._first_token_id([settings.get("pad_token"), "<pad>", "[PAD]"])
        self.pad = eod if pad is None else pad
        self.vocab_size = int(self._tokenizer.get_vocab_size(with_added_tokens=True))
        super().__init__(path=str(directory.resolve()), special_tokens=tuple(extra))

    def _first_token_id(self, candidates: Sequence[Any]) -> int | None:
        for token in candidates:
            if isinstance(token, dict):
                token = token.get("content")
            if token:
                token_id = self._tokenizer.token_to_id(str(token))
                if token_id is not None:
                    return int(token_id)
        return None

    def tokenize(self, text: str) -> list[int]:
        """Encode without adding special tokens."""
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Decode (special tokens skipped)."""
        return str(self._tokenizer.decode([int(i) for i in ids]))


def _read_special_token_settings(directory: Path) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        file = directory / name
        if file.is_file():
            try:
                data = json.loads(file.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                continue
            for key in ("eos_token", "pad_token"):
                if data.get(key) and key not in settings:
                    settings[key] = data[key]
    return settings


def build_tokenizer(tokenizer_config: TokenizerConfig | TokenizerConfigProtocol) -> Tokenizer:
    """Build the tokenizer a ``TokenizerConfig`` describes.

    Every ``TokenizerConfig.tokenizer_type`` is built: ``"ByteLevelTokenizer"``
    (``special_tokens``, ``vocab_extra_ids``, optional ``vocab_size``),
    ``"HuggingFaceTokenizer"`` (``tokenizer_model`` is a local directory),
    ``"NullTokenizer"`` (``vocab_size``), ``"SentencePieceTokenizer"`` and ``"TikTokenizer"``
    (``tokenizer_model`` is the model / vocabulary file) and ``"GPT2BPETokenizer"``
    (``vocab_file``, ``merge_file``).

    Args:
        tokenizer_config: ``bridge.config.TokenizerConfig`` (or an object with its fields).

    Returns:
        The tokenizer.

    Raises:
        ValueError: Unset or unknown ``tokenizer_type``, or a missing field.
        ImportError: The type's optional package is missing (names the extra to install).
    """
    kind = getattr(tokenizer_config, "tokenizer_type", None)
    if kind not in TOKENIZER_EXTRAS:
        raise ValueError(
            f"tokenizer.tokenizer_type={kind!r} is not a tokenizer type; use one of "
            f"{', '.join(map(repr, TOKENIZER_EXTRAS))}"
        )
    for name in TOKENIZER_REQUIRED_FIELDS.get(kind, ()):
        if getattr(tokenizer_config, name, None) in (None, ""):
            hint = (
                " (a local directory with tokenizer.json)" if kind == "HuggingFaceTokenizer" else ""
            )
            raise ValueError(f"tokenizer.{name} is required for tokenizer_type={kind!r}{hint}")
    specials = getattr(tokenizer_config, "special_tokens", None)
    extra_ids = int(getattr(tokenizer_config, "vocab_extra_ids", 0) or 0)
    vocab_size: Any = getattr(tokenizer_config, "vocab_size", None)
    # The required fields (checked above) are the files, given in their order.
    paths = [getattr(tokenizer_config, name) for name in TOKENIZER_REQUIRED_FIELDS.get(kind, ())]
    if kind == "ByteLevelTokenizer":
        return ByteLevelTokenizer(
            special_tokens=specials, vocab_extra_ids=extra_ids, vocab_size=vocab_size
        )
    if kind == "NullTokenizer":
        return NullTokenizer(int(vocab_size) + extra_ids)
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(paths[0], special_tokens=specials, vocab_extra_ids=extra_ids)
    from bridge.train.data import file_tokenizers

    cls = getattr(file_tokenizers, kind)
    return cls(*paths, special_tokens=specials, vocab_extra_ids=extra_ids, vocab_size=vocab_size)


# The function a worker process of map_in_processes applies (see _worker_start).
_worker_function: Callable[[Any], Any] | None = None


def _worker_start(function: Callable[[Any], Any]) -> None:
    global _worker_function
    _worker_function = function


def _call_in_worker(item: Any) -> Any:
    assert _worker_function is not None  # the pool's initializer set it
    return _worker_function(item)


def map_in_processes[T, R](
    function: Callable[[T], R], items: Iterable[T], workers: int
) -> Iterator[R]:
    """``function(item)`` for every item, in input order, in ``workers`` processes (1: this
    one): how preprocessing and the SFT datasets tokenize many documents at once.

    Items are drawn as the workers need them, so a stream stays a stream. ``function`` (and
    the tokenizer it holds) reaches each worker once: the platform's start method (fork on
    Linux, which hands it over without pickling; spawn on macOS, where fork in a process that
    has loaded torch is unsafe) runs the pool's initializer with it, never once per item.
    """
    if workers <= 1:
        yield from map(function, items)
        return
    with multiprocessing.Pool(workers, initializer=_worker_start, initargs=(function,)) as pool:
        yield from pool.imap(_call_in_worker, items, chunksize=64)
