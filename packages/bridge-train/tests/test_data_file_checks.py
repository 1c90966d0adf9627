"""Damaged ``.bin``/``.idx`` files and token ids beyond the vocabulary, refused before launch.

Each case runs the ``bridge-train`` entry (``bridge.train.cli.main``, ``text_corpus``
recipe) in this process: the check runs before any process group, so nothing is trained;
the exit code is 2 and stderr holds one line naming the file and the fix.
"""

from __future__ import annotations

import contextlib
import io
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from bridge.train.data import ByteLevelTokenizer, preprocess_data
from bridge.train.data.file_checks import DataFileError, check_indexed_dataset


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    text = root / "docs.txt"
    text.write_text("\n".join(f"document number {i} with some words" for i in range(200)))
    prefix = root / "corpus"
    preprocess_data([text], prefix, ByteLevelTokenizer(), split_lines=True)
    return prefix


def _copy(corpus: Path, directory: Path) -> Path:
    prefix = directory / "corpus"
    for ext in (".bin", ".idx"):
        shutil.copy(f"{corpus}{ext}", f"{prefix}{ext}")
    return prefix


def _cli(prefix: Path, *extra: str) -> tuple[object, list[str], str]:
    from bridge.train.cli import main

    err = io.StringIO()
    code: object = None
    with contextlib.redirect_stderr(err):
        try:
            main(["--recipe", "text_corpus", f"dataset.blend=[[{prefix}],null]", *extra])
        except SystemExit as exc:
            code = exc.code
    lines = [line for line in err.getvalue().splitlines() if line.startswith("bridge-train:")]
    return code, lines, err.getvalue()


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _big_token(path: Path) -> None:
    tokens = np.fromfile(path, dtype=np.uint16)
    tokens[len(tokens) // 2] = 4000
    tokens.tofile(path)


CASES: dict[str, tuple[Callable[[Path], object], str, str]] = {
    "truncated_bin": (
        lambda p: _truncate(p.with_suffix(".bin")),
        "corpus.bin is truncated",
        "bridge-preprocess-data",
    ),
    "longer_bin": (
        lambda p: p.with_suffix(".bin").write_bytes(p.with_suffix(".bin").read_bytes() + b"xx"),
        "corpus.bin is longer than its index describes",
        "bridge-preprocess-data",
    ),
    "garbage_idx": (
        lambda p: p.with_suffix(".idx").write_bytes(b"not an index at all" * 10),
        "corpus.idx is not a megatron index file",
        "bridge-preprocess-data",
    ),
    "empty_idx": (
        lambda p: p.with_suffix(".idx").write_bytes(b""),
        "corpus.idx is not a megatron index",
        "bridge-preprocess-data",
    ),
    "truncated_idx": (
        lambda p: _truncate(p.with_suffix(".idx"), 0.6),
        "corpus.idx is truncated",
        "bridge-preprocess-data",
    ),
    "token_beyond_vocab": (
        lambda p: _big_token(p.with_suffix(".bin")),
        "holds token id 4000, outside the vocabulary of 258",
        "tokenizer.vocab_size",
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_damaged_data_files_are_refused_before_launch(
    corpus: Path, tmp_path: Path, name: str
) -> None:
    damage, named, fix = CASES[name]
    prefix = _copy(corpus, tmp_path)
    damage(prefix)
    code, lines, err = _cli(prefix)
    assert code == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert "dataset.blend" in lines[0] and named in lines[0] and fix in lines[0], lines[0]


def test_intact_files_pass_and_the_vocabulary_is_checked(corpus: Path) -> None:
    check_indexed_dataset(corpus, 258)
    with pytest.raises(DataFileError, match="outside the vocabulary of 100"):
        check_indexed_dataset(corpus, 100)


def test_an_unknown_token_type_is_refused(corpus: Path, tmp_path: Path) -> None:
    prefix = _copy(corpus, tmp_path)
    index = bytearray(prefix.with_suffix(".idx").read_bytes())
    index[17] = 9  # the token type code, after the 9-byte header and the 8-byte version
    prefix.with_suffix(".idx").write_bytes(bytes(index))
    with pytest.raises(DataFileError, match="unknown index version 1 or token type 9"):
        check_indexed_dataset(prefix, 258)
