"""Turn text files or JSONL into megatron indexed datasets (``.bin`` + ``.idx``).

Each document (a text file, or a JSON line's ``--json-key`` field) is tokenized, its ids
are written with megatron-core's ``IndexedDatasetBuilder`` followed by the tokenizer's EOD
id, and the document is closed, so megatron's ``GPTDataset`` sees document boundaries.

Command line (also ``python -m bridge.train.data.preprocess``)::

    bridge-preprocess-data --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type ByteLevelTokenizer

Inputs ending in ``.jsonl`` / ``.json`` are read as JSON lines; other files are one
document each (``--split-lines`` makes every non-empty line a document).

``--workers N`` tokenizes in N processes (documents are handed out in chunks and their ids
written back in input order, so the files are byte for byte those of one process, as in
megatron's ``preprocess_data.py``); the command reports its progress every few seconds.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bridge.config.notices import held_notices, print_held_notices
from bridge.train.data.tokenizers import (
    TOKENIZER_EXTRAS,
    Tokenizer,
    build_tokenizer,
    map_in_processes,
)

__all__ = [
    "PreprocessProgress",
    "PreprocessResult",
    "build_parser",
    "jsonl_records",
    "main",
    "preprocess_data",
]


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
class PreprocessProgress:
    """How far :func:`preprocess_data` is (given to its ``progress`` callback).

    Attributes:
        documents: Documents written so far.
        tokens: Token ids written so far, EOD ids included.
        bytes_read: Input bytes read so far.
        bytes_total: Size of all inputs.
        seconds: Time since the start.
    """

    documents: int
    tokens: int
    bytes_read: int
    bytes_total: int
    seconds: float


def jsonl_records(path: Path) -> Iterator[tuple[int, Any, int]]:
    """``(line number, record, bytes read)`` of every non-blank line of a JSON-lines file
    (bytes read: the file's bytes up to the end of that line, for progress reports).

    Raises:
        ValueError: A line is not JSON; the message names the file and the line.
    """
    read = 0
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            read += len(line)
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path} line {number}: not valid JSON ({exc.msg})") from None
                yield number, record, read


def _documents(
    paths: Sequence[Path], json_key: str, split_lines: bool
) -> Iterator[tuple[str, int]]:
    """Each document's text, with the input bytes read once it is (for progress reports:
    text lines are counted by their UTF-8 length, so a CRLF line counts one byte short)."""
    done = 0
    for path in paths:
        if path.suffix in (".jsonl", ".json"):
            for number, record, read in jsonl_records(path):
                if not isinstance(record, dict) or json_key not in record:
                    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise ValueError(
                        f"{path} line {number}: no key {json_key!r} (found {keys}); pass "
                        "--json-key with the field holding the text"
                    )
                yield str(record[json_key]), done + read
            done += path.stat().st_size
        elif split_lines:
            with path.open(encoding="utf-8") as handle:
                for line in handle:
                    done += len(line.encode("utf-8"))
                    if line.strip():
                        yield line.rstrip("\n"), done
        else:
            text = path.read_text(encoding="utf-8")
            done += path.stat().st_size
            yield text, done


def _tokenize_document(tokenizer: Tokenizer, document: tuple[str, int]) -> tuple[list[int], int]:
    """``(ids, bytes read)`` of a ``(text, bytes read)`` document."""
    text, done = document
    return list(tokenizer.tokenize(text)), done


def preprocess_data(
    inputs: Iterable[str | Path],
    output_prefix: str | Path,
    tokenizer: Tokenizer,
    *,
    json_key: str = "text",
    split_lines: bool = False,
    append_eod: bool = True,
    overwrite: bool = False,
    workers: int = 1,
    progress: Callable[[PreprocessProgress], None] | None = None,
    progress_interval: float = 5.0,
) -> PreprocessResult:
    """Tokenize ``inputs`` into ``<output_prefix>.bin`` / ``.idx``.

    The files are written under temporary names and renamed at the end, so an interrupted
    run never leaves a half-written dataset under the final name. With ``workers`` > 1 the
    documents are tokenized in that many processes and written in input order: the files
    are the same bytes as with one.

    Args:
        inputs: Text files (one document each, or one per line with ``split_lines``) and/or
            JSONL files (one document per line, text under ``json_key``).
        output_prefix: Output path prefix.
        tokenizer: Tokenizer with ``tokenize`` and ``eod``.
        json_key: JSON field holding the text.
        split_lines: Treat every non-empty line of a text file as a document.
        append_eod: Append the EOD id after every document.
        overwrite: Replace existing output files (refused otherwise).
        workers: Processes that tokenize (1: this process).
        progress: Called every ``progress_interval`` seconds while documents are written,
            and once at the end.
        progress_interval: Seconds between two ``progress`` calls.

    Returns:
        Counts of what was written.

    Raises:
        FileNotFoundError: An input does not exist.
        FileExistsError: The output files exist and ``overwrite`` is false.
        ValueError: No input given, the inputs hold no document, a JSON line is malformed
            or lacks ``json_key``, or ``workers`` < 1.
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
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
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
    documents = tokens = read = 0
    total = sum(p.stat().st_size for p in paths)
    started = last_report = time.monotonic()

    def report() -> None:
        if progress is not None:
            progress(PreprocessProgress(documents, tokens, read, total, time.monotonic() - started))

    try:
        import torch

        tokenize = functools.partial(_tokenize_document, tokenizer)
        stream = map_in_processes(tokenize, _documents(paths, json_key, split_lines), workers)
        for ids, bytes_read in stream:
            read = bytes_read
            if append_eod:
                ids = [*ids, tokenizer.eod]
            if ids:
                builder.add_item(torch.tensor(np.asarray(ids, dtype=np.int64)))
                builder.end_document()
                documents += 1
                tokens += len(ids)
            if progress is not None and time.monotonic() - last_report >= progress_interval:
                last_report = time.monotonic()
                report()
        builder.finalize(str(tmp_idx))
        report()
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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``bridge-preprocess-data``."""
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
        choices=list(TOKENIZER_EXTRAS),
    )
    parser.add_argument(
        "--tokenizer-model",
        help="local Hugging Face tokenizer directory, SentencePiece .model or tiktoken .json",
    )
    parser.add_argument("--vocab-file", help="GPT-2 BPE vocab.json (GPT2BPETokenizer)")
    parser.add_argument("--merge-file", help="GPT-2 BPE merges.txt (GPT2BPETokenizer)")
    parser.add_argument("--vocab-size", type=int, help="vocabulary size (NullTokenizer)")
    parser.add_argument("--special-tokens", nargs="*", help="extra special tokens")
    for flag, text in (
        ("--no-append-eod", "do not append EOD to documents"),
        ("--overwrite", "replace existing output files"),
        ("--verbose", "print the notices of torch and megatron-core in full (default: one line)"),
    ):
        parser.add_argument(flag, action="store_true", help=text)
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="processes that tokenize (default 1; the output is the same for any number)",
    )
    return parser


#: Seconds between the command's progress lines (a shorter run prints none).
_PROGRESS_INTERVAL = 5.0


def _print_progress(state: PreprocessProgress) -> None:
    if state.seconds < _PROGRESS_INTERVAL:
        return
    share = f" ({100 * state.bytes_read / state.bytes_total:.0f}%)" if state.bytes_total else ""
    print(
        f"bridge-preprocess-data: {state.documents:,} documents, {state.tokens:,} tokens, "
        f"{state.bytes_read / 1e6:.1f} of {state.bytes_total / 1e6:.1f} MB read{share}, "
        f"{state.seconds:.0f} s",
        file=sys.stderr,
        flush=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of ``bridge-preprocess-data``.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        0 on success, 1 on a user error (printed to stderr, no traceback).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    # megatron-core's import notices (it writes the files) say nothing about the data.
    # A refused input is the one line the command prints (the notices do not matter then).
    with held_notices(("torch.utils.cpp_extension", "megatron")) as held:
        code, last_line = _preprocess(args)
    if code == 0:
        print_held_notices(
            held,
            "bridge-preprocess-data: ",
            verbose=args.verbose,
            how_to_see="--verbose prints them",
        )
    print(last_line, file=sys.stderr if code else sys.stdout, flush=True)
    return code


def _preprocess(args: argparse.Namespace) -> tuple[int, str]:
    """Tokenize as ``args`` say: ``(exit code, the line that ends the command)``."""
    try:
        # The --tokenizer-* options are named as TokenizerConfig's fields.
        tokenizer = build_tokenizer(args)
        result = preprocess_data(
            args.input,
            args.output_prefix,
            tokenizer,
            json_key=args.json_key,
            split_lines=args.split_lines,
            append_eod=not args.no_append_eod,
            overwrite=args.overwrite,
            workers=args.workers,
            progress=_print_progress,
            progress_interval=_PROGRESS_INTERVAL,
        )
    except (FileNotFoundError, FileExistsError, ValueError, ImportError) as exc:
        return 1, f"bridge-preprocess-data: error: {exc}"
    return 0, (
        f"wrote {result.num_documents} documents, {result.num_tokens} tokens to "
        f"{result.output_prefix}.bin/.idx"
    )


if __name__ == "__main__":
    raise SystemExit(main())
