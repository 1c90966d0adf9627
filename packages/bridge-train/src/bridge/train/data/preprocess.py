"""Turn text files or JSONL into megatron indexed datasets (``.bin`` + ``.idx``).

Each document (a text file, or a JSON line's ``--json-key`` field) is tokenized, its ids
are written with megatron-core's ``IndexedDatasetBuilder`` followed by the tokenizer's EOD
id, and the document is closed, so megatron's ``GPTDataset`` sees document boundaries.

Command line (also ``python -m bridge.train.data.preprocess``)::

    bridge-preprocess-data --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type ByteLevelTokenizer

Inputs ending in ``.jsonl`` / ``.json`` are read as JSON lines; other files are one
document each (``--split-lines`` makes every non-empty line a document).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bridge.train.data.tokenizers import Tokenizer, build_tokenizer

__all__ = ["PreprocessResult", "main", "preprocess_data"]


@dataclass(frozen=True)
class PreprocessResult:
    """What :func:`preprocess_data` wrote.

    Attributes:
        output_prefix: Prefix of the ``.bin`` / ``.idx`` pair.
        num_documents: Documents written.
        num_tokens: Token ids written, EOD ids included.
    """

    output_prefix: str
    num_documents: int
    num_tokens: int


@dataclass(frozen=True)
class _TokenizerSpec:
    tokenizer_type: str
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None
    special_tokens: list[str] | None = None
    vocab_extra_ids: int = 0


def _documents(paths: Sequence[Path], json_key: str, split_lines: bool) -> Iterator[str]:
    for path in paths:
        if path.suffix in (".jsonl", ".json"):
            with path.open(encoding="utf-8") as handle:
                for line_number, line in enumerate(handle, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ValueError(
                            f"{path}:{line_number}: not valid JSON ({exc.msg})"
                        ) from None
                    if not isinstance(record, dict) or json_key not in record:
                        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                        raise ValueError(
                            f"{path}:{line_number}: no key {json_key!r} (found {keys}); pass "
                            "--json-key with the field holding the text"
                        )
                    yield str(record[json_key])
        elif split_lines:
            with path.open(encoding="utf-8") as handle:
                for line in handle:
                    if line.strip():
                        yield line.rstrip("\n")
        else:
            yield path.read_text(encoding="utf-8")


def preprocess_data(
    inputs: Iterable[str | Path],
    output_prefix: str | Path,
    tokenizer: Tokenizer,
    *,
    json_key: str = "text",
    split_lines: bool = False,
    append_eod: bool = True,
    overwrite: bool = False,
) -> PreprocessResult:
    """Tokenize ``inputs`` into ``<output_prefix>.bin`` / ``.idx``.

    The files are written under temporary names and renamed at the end, so an interrupted
    run never leaves a half-written dataset under the final name.

    Args:
        inputs: Text files (one document each, or one per line with ``split_lines``) and/or
            JSONL files (one document per line, text under ``json_key``).
        output_prefix: Output path prefix.
        tokenizer: Tokenizer with ``tokenize`` and ``eod``.
        json_key: JSON field holding the text.
        split_lines: Treat every non-empty line of a text file as a document.
        append_eod: Append the EOD id after every document.
        overwrite: Replace existing output files (refused otherwise).

    Returns:
        Counts of what was written.

    Raises:
        FileNotFoundError: An input does not exist.
        FileExistsError: The output files exist and ``overwrite`` is false.
        ValueError: No input given, the inputs hold no document, a JSON line is malformed
            or lacks ``json_key``.
    """
    from megatron.core.datasets.indexed_dataset import (
        DType,
        IndexedDatasetBuilder,
        get_bin_path,
        get_idx_path,
    )

    paths = [Path(p) for p in inputs]
    if not paths:
        raise ValueError("no input files given; pass --input FILE [FILE ...]")
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"input file(s) not found: {missing}")
    prefix = str(output_prefix)
    bin_path, idx_path = Path(get_bin_path(prefix)), Path(get_idx_path(prefix))
    existing = [str(p) for p in (bin_path, idx_path) if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(
            f"output {existing} already exists; choose another --output-prefix or pass "
            "--overwrite to replace it"
        )
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_bin = bin_path.with_name(bin_path.name + ".tmp")
    tmp_idx = idx_path.with_name(idx_path.name + ".tmp")
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builder = IndexedDatasetBuilder(str(tmp_bin), dtype=dtype)
    documents = tokens = 0
    try:
        import torch

        for text in _documents(paths, json_key, split_lines):
            ids = tokenizer.tokenize(text)
            if append_eod:
                ids = [*ids, tokenizer.eod]
            if not ids:
                continue
            builder.add_item(torch.tensor(np.asarray(ids, dtype=np.int64)))
            builder.end_document()
            documents += 1
            tokens += len(ids)
        builder.finalize(str(tmp_idx))
        if documents == 0:
            raise ValueError(
                f"the input {[str(p) for p in paths]} holds no document (empty files or lines); "
                "nothing was written"
            )
        tmp_bin.replace(bin_path)
        tmp_idx.replace(idx_path)
    finally:
        if not builder.data_file.closed:  # an error before finalize() closed it
            builder.data_file.close()
        for tmp in (tmp_bin, tmp_idx):
            tmp.unlink(missing_ok=True)
    return PreprocessResult(prefix, documents, tokens)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bridge-preprocess-data",
        description="Tokenize text or JSONL files into a megatron indexed dataset (.bin/.idx).",
    )
    parser.add_argument("--input", nargs="+", required=True, help="text or .jsonl files")
    parser.add_argument("--output-prefix", required=True, help="output path prefix (no extension)")
    parser.add_argument(
        "--json-key", default="text", help="JSON field with the text (default: text)"
    )
    parser.add_argument(
        "--split-lines",
        action="store_true",
        help="every non-empty line of a text file is a document",
    )
    parser.add_argument(
        "--tokenizer-type",
        default="ByteLevelTokenizer",
        choices=[
            "ByteLevelTokenizer",
            "HuggingFaceTokenizer",
            "NullTokenizer",
            "SentencePieceTokenizer",
            "TikTokenizer",
            "GPT2BPETokenizer",
        ],
    )
    parser.add_argument(
        "--tokenizer-model",
        help="local Hugging Face tokenizer directory, SentencePiece .model or tiktoken .json",
    )
    parser.add_argument("--vocab-file", help="GPT-2 BPE vocab.json (GPT2BPETokenizer)")
    parser.add_argument("--merge-file", help="GPT-2 BPE merges.txt (GPT2BPETokenizer)")
    parser.add_argument("--vocab-size", type=int, help="vocabulary size (NullTokenizer)")
    parser.add_argument("--special-tokens", nargs="*", help="extra special tokens")
    parser.add_argument(
        "--no-append-eod", action="store_true", help="do not append EOD to documents"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace existing output files")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of ``bridge-preprocess-data``.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        0 on success, 1 on a user error (printed to stderr, no traceback).
    """
    args = _parser().parse_args(argv)
    spec: Any = _TokenizerSpec(
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        vocab_size=args.vocab_size,
        special_tokens=args.special_tokens,
    )
    try:
        tokenizer = build_tokenizer(spec)
        result = preprocess_data(
            args.input,
            args.output_prefix,
            tokenizer,
            json_key=args.json_key,
            split_lines=args.split_lines,
            append_eod=not args.no_append_eod,
            overwrite=args.overwrite,
        )
    except (FileNotFoundError, FileExistsError, ValueError, ImportError) as exc:
        print(f"bridge-preprocess-data: error: {exc}", file=sys.stderr)
        return 1
    print(
        f"wrote {result.num_documents} documents, {result.num_tokens} tokens to "
        f"{result.output_prefix}.bin/.idx"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
