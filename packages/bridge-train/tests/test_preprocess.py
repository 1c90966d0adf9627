"""bridge-preprocess-data: text/JSONL to megatron indexed datasets, with clear errors."""

from __future__ import annotations

import itertools

import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from bridge.train.data import ByteLevelTokenizer, preprocess_data
from bridge.train.data.preprocess import main


def _documents(prefix: str, tok: ByteLevelTokenizer) -> list[str]:
    dataset = IndexedDataset(prefix)
    return [tok.detokenize(dataset[i].tolist()) for i in range(len(dataset))]


def test_jsonl_documents_are_written_with_eod(tmp_path, corpus_jsonl, corpus_documents) -> None:
    tok = ByteLevelTokenizer()
    result = preprocess_data([corpus_jsonl], tmp_path / "out" / "corpus", tok)
    assert result.num_documents == 8 * len(corpus_documents)
    docs = _documents(result.output_prefix, tok)
    assert docs[: len(corpus_documents)] == [d + "<eod>" for d in corpus_documents]
    assert result.num_tokens == sum(len(d.encode()) + 1 for d in corpus_documents) * 8


def test_text_files_are_one_document_each_or_one_per_line(tmp_path) -> None:
    tok = ByteLevelTokenizer()
    (tmp_path / "a.txt").write_text("first line\nsecond line\n\n", encoding="utf-8")
    (tmp_path / "b.txt").write_text("other file", encoding="utf-8")
    whole = preprocess_data([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "whole", tok)
    assert _documents(whole.output_prefix, tok) == [
        "first line\nsecond line\n\n<eod>",
        "other file<eod>",
    ]
    lines = preprocess_data([tmp_path / "a.txt"], tmp_path / "lines", tok, split_lines=True)
    assert _documents(lines.output_prefix, tok) == ["first line<eod>", "second line<eod>"]


def test_custom_json_key(tmp_path) -> None:
    (tmp_path / "d.jsonl").write_text('{"content": "abc"}\n{"content": "de"}\n', encoding="utf-8")
    tok = ByteLevelTokenizer()
    result = preprocess_data([tmp_path / "d.jsonl"], tmp_path / "k", tok, json_key="content")
    assert _documents(result.output_prefix, tok) == ["abc<eod>", "de<eod>"]
    with pytest.raises(ValueError, match=r"d.jsonl line 1: no key 'text'.*--json-key"):
        preprocess_data([tmp_path / "d.jsonl"], tmp_path / "k2", tok)


def test_missing_and_empty_inputs_are_refused(tmp_path) -> None:
    tok = ByteLevelTokenizer()
    with pytest.raises(FileNotFoundError, match=r"nope.txt"):
        preprocess_data([tmp_path / "nope.txt"], tmp_path / "x", tok)
    (tmp_path / "empty.jsonl").write_text("\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"holds no document"):
        preprocess_data([tmp_path / "empty.jsonl"], tmp_path / "x", tok)
    assert not list(tmp_path.glob("x*")), "nothing may be left behind"
    with pytest.raises(ValueError, match=r"no input files"):
        preprocess_data([], tmp_path / "x", tok)


def test_existing_output_is_never_overwritten_without_overwrite(tmp_path, corpus_jsonl) -> None:
    tok = ByteLevelTokenizer()
    prefix = tmp_path / "corpus"
    preprocess_data([corpus_jsonl], prefix, tok)
    before = (tmp_path / "corpus.bin").read_bytes()
    (tmp_path / "small.jsonl").write_text('{"text": "tiny"}\n', encoding="utf-8")
    with pytest.raises(FileExistsError, match=r"--overwrite"):
        preprocess_data([tmp_path / "small.jsonl"], prefix, tok)
    assert (tmp_path / "corpus.bin").read_bytes() == before
    preprocess_data([tmp_path / "small.jsonl"], prefix, tok, overwrite=True)
    assert _documents(str(prefix), tok) == ["tiny<eod>"]


def test_command_line(tmp_path, corpus_jsonl, capsys) -> None:
    prefix = tmp_path / "cli"
    assert main(["--input", str(corpus_jsonl), "--output-prefix", str(prefix)]) == 0
    assert "wrote 48 documents" in capsys.readouterr().out
    assert main(["--input", str(corpus_jsonl), "--output-prefix", str(prefix)]) == 1
    err = capsys.readouterr().err
    assert "already exists" in err and "--overwrite" in err
    assert main(["--input", str(tmp_path / "missing.jsonl"), "--output-prefix", str(prefix)]) == 1
    assert "missing.jsonl" in capsys.readouterr().err


def test_workers_write_the_same_files_as_one_process(tmp_path, corpus_documents) -> None:
    # Enough documents for several chunks per worker, in a JSONL and a text file.
    jsonl = tmp_path / "many.jsonl"
    jsonl.write_text(
        "".join(f'{{"text": "{i}: {corpus_documents[i % 6]}"}}\n' for i in range(700)),
        encoding="utf-8",
    )
    lines = tmp_path / "lines.txt"
    lines.write_text("".join(f"line {i} {'x' * (i % 17)}\n" for i in range(300)))
    tok = ByteLevelTokenizer()
    outputs = {}
    for workers in (1, 3):
        prefix = tmp_path / f"w{workers}"
        result = preprocess_data([jsonl, lines], prefix, tok, split_lines=True, workers=workers)
        assert result.num_documents == 1000
        outputs[workers] = (
            (tmp_path / f"w{workers}.bin").read_bytes(),
            (tmp_path / f"w{workers}.idx").read_bytes(),
        )
    assert outputs[3] == outputs[1]
    with pytest.raises(ValueError, match="workers must be at least 1"):
        preprocess_data([jsonl], tmp_path / "none", tok, workers=0)


def test_progress_is_reported_while_writing(tmp_path, corpus_jsonl, capsys) -> None:
    from bridge.train.data.preprocess import PreprocessProgress, _print_progress

    seen: list[PreprocessProgress] = []
    preprocess_data(
        [corpus_jsonl],
        tmp_path / "p",
        ByteLevelTokenizer(),
        progress=seen.append,
        progress_interval=0.0,  # every document
    )
    assert len(seen) == 48 + 1  # each document, then the end
    assert [p.documents for p in seen[:3]] == [1, 2, 3]
    assert seen[-1].bytes_read == seen[-1].bytes_total == corpus_jsonl.stat().st_size
    assert all(a.bytes_read <= b.bytes_read for a, b in itertools.pairwise(seen))
    # The command's line for such a report (none before its first interval has passed).
    _print_progress(PreprocessProgress(3, 120, 2_500_000, 5_000_000, 4.0))
    _print_progress(PreprocessProgress(1_234, 56_789, 2_500_000, 5_000_000, 6.0))
    assert capsys.readouterr().err == (
        "bridge-preprocess-data: 1,234 documents, 56,789 tokens, 2.5 of 5.0 MB read (50%), 6 s\n"
    )
    # The command takes --workers; a value below 1 is refused naming it.
    with pytest.raises(SystemExit):
        main(
            ["--input", str(corpus_jsonl), "--output-prefix", str(tmp_path / "q"), "--workers", "0"]
        )
    assert "--workers must be at least 1" in capsys.readouterr().err
    assert (
        main(
            ["--input", str(corpus_jsonl), "--output-prefix", str(tmp_path / "q"), "--workers", "2"]
        )
        == 0
    )
