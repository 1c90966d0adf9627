"""SentencePiece, tiktoken and GPT-2 BPE tokenizers end to end, from files written here.

Each type builds from ``TokenizerConfig``, round-trips text, has what the data pipeline
needs, preprocesses a corpus with ``bridge-preprocess-data`` and trains a tiny model on it
with ``pretrain``. A type whose optional package is missing is refused at config time with
one line naming the extra (exit 2). Nothing is downloaded.
"""

from __future__ import annotations

import base64
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from bridge.config import TokenizerConfig
from bridge.train.data.file_tokenizers import (
    GPT2BPETokenizer,
    SentencePieceTokenizer,
    TikTokenizer,
)
from bridge.train.data.tokenizers import build_tokenizer
from core_utils.testing import run_distributed

_SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "hello bridge world",
    "training tiny models on a cpu is slow but it works",
]
# Text made of the sentences' characters, so every tokenizer here round-trips it exactly.
_TEXT = "hello world the lazy fox works"
_TIKTOKEN_MERGES = [b"th", b"the", b"he", b"ll", b"llo", b" w", b"or"]
_GPT2_MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w"), ("o", "r")]


def _write_sentencepiece(directory: Path) -> Path:
    import sentencepiece

    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_SENTENCES * 4),
        model_prefix=str(directory / "sp"),
        vocab_size=48,
        model_type="bpe",
        character_coverage=1.0,
        minloglevel=2,
    )
    return directory / "sp.model"


def _write_tiktoken(directory: Path) -> Path:
    """megatron's tiktoken format: a JSON list of ranks, the first 256 the single bytes."""
    pieces = [bytes([i]) for i in range(256)] + _TIKTOKEN_MERGES
    entries = [
        {
            "rank": rank,
            "token_bytes": base64.b64encode(piece).decode("ascii"),
            "token_str": piece.decode("utf-8", errors="replace"),
        }
        for rank, piece in enumerate(pieces)
    ]
    path = directory / "tiktoken.json"
    path.write_text(json.dumps(entries), encoding="utf-8")
    return path


def _write_gpt2(directory: Path) -> tuple[Path, Path]:
    """A GPT-2 vocab.json (the 256 byte symbols, merges, <|endoftext|>) and merges.txt."""
    from tokenizers import pre_tokenizers

    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for left, right in _GPT2_MERGES:
        vocab[left + right] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    merges = "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in _GPT2_MERGES)
    (directory / "merges.txt").write_text(merges, encoding="utf-8")
    return directory / "vocab.json", directory / "merges.txt"


def _config(kind: Any, directory: Path, **fields: Any) -> TokenizerConfig:
    if kind == "SentencePieceTokenizer":
        model = directory / "sp.model"
        if not model.exists():
            _write_sentencepiece(directory)
        return TokenizerConfig(tokenizer_type=kind, tokenizer_model=str(model), **fields)
    if kind == "TikTokenizer":
        return TokenizerConfig(
            tokenizer_type=kind, tokenizer_model=str(_write_tiktoken(directory)), **fields
        )
    vocab, merges = _write_gpt2(directory)
    return TokenizerConfig(
        tokenizer_type=kind, vocab_file=str(vocab), merge_file=str(merges), **fields
    )


_TYPES = ["SentencePieceTokenizer", "TikTokenizer", "GPT2BPETokenizer"]
# (class, vocab_size, eod, pad) each type has from the files above.
_EXPECTED: dict[str, tuple[type, int, int, int]] = {
    "SentencePieceTokenizer": (SentencePieceTokenizer, 48, 2, -1),
    # megatron's 1000 special ids, then 256 bytes and 7 merges; </s> is 2, <pad> 4
    "TikTokenizer": (TikTokenizer, 1000 + 256 + 7, 2, 4),
    # 256 byte symbols, 5 merges, <|endoftext|>
    "GPT2BPETokenizer": (GPT2BPETokenizer, 256 + 5 + 1, 261, 261),
}


@pytest.mark.parametrize("kind", _TYPES)
def test_builds_from_config_and_round_trips(tmp_path: Path, kind: str) -> None:
    tok = build_tokenizer(_config(kind, tmp_path))
    cls, vocab_size, eod, pad = _EXPECTED[kind]
    assert isinstance(tok, cls)
    assert (tok.vocab_size, tok.eod, tok.pad) == (vocab_size, eod, pad)
    ids = tok.tokenize(_TEXT)
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
    assert len(ids) < len(_TEXT)  # merges are applied, not one id per character
    assert tok.detokenize(ids) == _TEXT
    assert tok.unique_identifiers["class"] == kind
    assert tok.unique_identifiers["vocab_size"] == vocab_size


@pytest.mark.parametrize("kind", _TYPES)
def test_special_tokens_and_extra_ids_are_added(tmp_path: Path, kind: str) -> None:
    tok = build_tokenizer(_config(kind, tmp_path, special_tokens=["<bos>"], vocab_extra_ids=2))
    base = _EXPECTED[kind][1]
    if kind == "TikTokenizer":  # they take reserved special ids, the size does not change
        assert tok.vocab_size == base
        assert tok.tokenize("<bos>") == [7]
    else:
        assert tok.vocab_size == base + 3
        assert tok.tokenize("<extra_id_1>") == [tok.vocab_size - 1]
    assert "<bos>" in tok.unique_identifiers["special_tokens"]


def test_bad_files_and_sizes_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer.tokenizer_model=.*is not a file"):
        SentencePieceTokenizer(tmp_path / "missing.model")
    (tmp_path / "garbage.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"is not a tiktoken vocabulary"):
        TikTokenizer(tmp_path / "garbage.json")
    tiktoken_file = _write_tiktoken(tmp_path)
    with pytest.raises(ValueError, match=r"tokenizer.vocab_size=5000 does not fit"):
        TikTokenizer(tiktoken_file, vocab_size=5000)
    assert TikTokenizer(tiktoken_file, vocab_size=1258).vocab_size == 1258  # cut to fit
    vocab, merges = _write_gpt2(tmp_path)
    with pytest.raises(ValueError, match=r"tokenizer.vocab_size=10 is smaller than the"):
        GPT2BPETokenizer(vocab, merges, vocab_size=10)
    assert GPT2BPETokenizer(vocab, merges, vocab_size=300).vocab_size == 300
    (tmp_path / "bad.json").write_text(json.dumps({"a": 0, "b": 1}))
    with pytest.raises(ValueError, match=r"are not GPT-2 BPE files: .*out of vocabulary"):
        GPT2BPETokenizer(tmp_path / "bad.json", merges)
    without_eod = json.loads(vocab.read_text())
    del without_eod["<|endoftext|>"]
    (tmp_path / "no-eod.json").write_text(json.dumps(without_eod))
    with pytest.raises(ValueError, match=r"has no '<\|endoftext\|>' token"):
        GPT2BPETokenizer(tmp_path / "no-eod.json", merges)


_MODULES = {
    "SentencePieceTokenizer": ("sentencepiece", "sentencepiece"),
    "TikTokenizer": ("tiktoken", "tiktoken"),
    "GPT2BPETokenizer": ("tokenizers", "hf"),
}


@pytest.mark.parametrize("kind", _TYPES)
def test_missing_package_is_refused_at_config_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    from bridge.train.cli import EXIT_CONFIG_ERROR, main

    config = _config(kind, tmp_path)
    module, extra = _MODULES[kind]
    monkeypatch.setitem(sys.modules, module, None)  # as if the extra were not installed
    files = [
        f"tokenizer.{name}={getattr(config, name)}"
        for name in ("tokenizer_model", "vocab_file", "merge_file")
        if getattr(config, name) is not None
    ]
    with pytest.raises(SystemExit) as info:
        main(["--dry-run", f"tokenizer.tokenizer_type={kind}", *files])
    assert info.value.code == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("[bridge-train] ")]
    assert lines == [
        f"bridge-train: error: tokenizer.tokenizer_type: {kind!r} needs the {module!r} "
        f"package, which is not installed; pip install 'bridge-train[{extra}]' (in a clone "
        f"of this repository: uv sync --inexact --extra {extra})"
    ]
    with pytest.raises(ImportError, match=rf"pip install 'bridge-train\[{extra}\]'"):
        build_tokenizer(config)


def test_missing_tokenizer_files_and_unused_fields_are_refused_at_config_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bridge.train.cli import EXIT_CONFIG_ERROR, main

    for argv, expected in [
        (
            ["tokenizer.tokenizer_type=TikTokenizer", "tokenizer.tokenizer_model=x.json"],
            "tokenizer.tokenizer_model: 'x.json' does not exist or is not a file",
        ),
        (
            [
                "tokenizer.tokenizer_type=GPT2BPETokenizer",
                f"tokenizer.vocab_file={_write_gpt2(tmp_path)[0]}",
                f"tokenizer.merge_file={tmp_path / 'nope.txt'}",
            ],
            f"tokenizer.merge_file: '{tmp_path / 'nope.txt'}' does not exist",
        ),
        (
            ["tokenizer.hf_tokenizer_kwargs={use_fast: true}"],
            "tokenizer.hf_tokenizer_kwargs: is not used",
        ),
    ]:
        with pytest.raises(SystemExit) as info:
            main(["--dry-run", *argv])
        assert info.value.code == EXIT_CONFIG_ERROR
        err = capsys.readouterr().err
        assert f"bridge-train: error: {expected}" in err, err
        assert "Traceback" not in err


def _preprocess(kind: str, directory: Path, corpus: Path) -> tuple[str, TokenizerConfig]:
    from bridge.train.data.preprocess import main

    config = _config(kind, directory)
    argv = ["--input", str(corpus), "--output-prefix", str(directory / "corpus")]
    argv += ["--tokenizer-type", kind]
    for name in ("tokenizer_model", "vocab_file", "merge_file"):
        if getattr(config, name) is not None:
            argv += [f"--{name.replace('_', '-')}", str(getattr(config, name))]
    assert main(argv) == 0
    return str(directory / "corpus"), config


def _train_each(rank: int, world: int, runs: list[tuple[str, str, TokenizerConfig]]) -> Any:
    from bridge.config import GPTDatasetConfig
    from bridge.train import pretrain
    from bridge.train.models import GPTModelProvider
    from bridge.train.models.gpt_step import forward_step
    from bridge.train.testing import (
        tiny_config_container,
        tiny_gpt_provider,
        tiny_train_config,
    )

    results = {}
    for kind, prefix, tokenizer in runs:
        cfg = tiny_config_container(
            model=tiny_gpt_provider(vocab_size=None),
            tokenizer=tokenizer,
            train=tiny_train_config(train_iters=3),
            dataset=GPTDatasetConfig(
                random_seed=7,
                sequence_length=16,
                blend=([prefix], None),
                split="1,0,0",
                reset_position_ids=False,
                reset_attention_mask=False,
                eod_mask_loss=False,
                num_workers=0,
                dataloader_type="single",
                path_to_cache=f"{prefix}-cache",
            ),
        )
        metrics = f"{prefix}-metrics.jsonl"
        code = pretrain(cfg, forward_step, metrics_file=metrics)
        assert isinstance(cfg.model, GPTModelProvider)
        results[kind] = (code, cfg.model.vocab_size, metrics)
    return results


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_preprocess_and_train_with_each_type(tmp_path: Path, corpus_jsonl: Path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from bridge.train.metrics import read_metrics_file

    runs = []
    for kind in _TYPES:
        directory = tmp_path / kind
        directory.mkdir()
        prefix, config = _preprocess(kind, directory, corpus_jsonl)
        tok = build_tokenizer(config)
        dataset = IndexedDataset(prefix)  # kept alive: its items are views of its memory map
        first = dataset[0].tolist()
        text = json.loads(corpus_jsonl.read_text(encoding="utf-8").splitlines()[0])["text"]
        assert first == [*tok.tokenize(text), tok.eod]  # each document closed by the EOD id
        del dataset
        runs.append((kind, prefix, config))
    (results,) = run_distributed(_train_each, 1, runs, timeout=210)
    for kind in _TYPES:
        code, model_vocab, metrics = results[kind]
        assert code == 0, kind
        assert model_vocab == _EXPECTED[kind][1]  # the model took its vocabulary from the files
        losses = [r["lm loss"] for r in read_metrics_file(Path(metrics)) if "lm loss" in r]
        assert len(losses) == 3 and all(math.isfinite(x) for x in losses), (kind, losses)
        # the first loss is about ln(vocabulary): the model starts at chance over it
        assert abs(losses[0] - math.log(model_vocab)) < 1.0, (kind, losses)
