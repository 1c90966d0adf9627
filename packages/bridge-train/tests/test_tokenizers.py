"""Byte-level, null and Hugging Face tokenizers, and build_tokenizer from TokenizerConfig."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

from bridge.config import TokenizerConfig
from bridge.train.data import (
    ByteLevelTokenizer,
    HuggingFaceTokenizer,
    NullTokenizer,
    build_tokenizer,
)


def test_byte_level_round_trips_unicode_and_has_eod_and_pad() -> None:
    tok = ByteLevelTokenizer()
    text = "naïve café, 数据 ✓"
    ids = tok.tokenize(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.detokenize(ids) == text
    assert (tok.vocab_size, tok.eod, tok.pad) == (258, 256, 257)
    assert tok.detokenize([*tok.tokenize("ab"), tok.eod]) == "ab<eod>"
    assert tok.unique_identifiers["class"] == "ByteLevelTokenizer"


def test_byte_level_special_tokens_extra_ids_and_size() -> None:
    tok = ByteLevelTokenizer(special_tokens=["<bos>"], vocab_extra_ids=2)
    assert tok.special_token_id("<bos>") == 256
    assert (tok.eod, tok.pad) == (257, 258)
    assert tok.vocab_size == 256 + 3 + 2
    assert ByteLevelTokenizer(vocab_size=300).vocab_size == 300
    with pytest.raises(ValueError, match=r"tokenizer.vocab_size=200 is too small.*258"):
        ByteLevelTokenizer(vocab_size=200)


def test_null_tokenizer_follows_megatron() -> None:
    tok = NullTokenizer(100)
    assert (tok.vocab_size, tok.eod, tok.pad) == (100, 99, -1)
    assert tok.tokenize("3 1 4") == [3, 1, 4]
    assert tok.detokenize([3, 1, 4]) == "3 1 4"
    with pytest.raises(ValueError, match=r"tokenizer.vocab_size must be >= 2"):
        NullTokenizer(1)


def test_build_tokenizer_from_config() -> None:
    byte = build_tokenizer(TokenizerConfig(tokenizer_type="ByteLevelTokenizer"))
    assert isinstance(byte, ByteLevelTokenizer)
    null = build_tokenizer(TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=64))
    assert isinstance(null, NullTokenizer) and null.vocab_size == 64
    with pytest.raises(ValueError, match=r"tokenizer_type='WordPiece' is not a tokenizer type"):
        build_tokenizer(SimpleNamespace(tokenizer_type="WordPiece"))
    # bridge-preprocess-data hands its options over unchecked: a missing file option is named.
    with pytest.raises(
        ValueError, match=r"tokenizer\.tokenizer_model is required .*tokenizer\.json"
    ):
        build_tokenizer(SimpleNamespace(tokenizer_type="HuggingFaceTokenizer"))


def _save_word_level_tokenizer(directory) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "</s>": 1, "<pad>": 2, "hello": 3, "world": 4, "bridge": 5}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["</s>", "<pad>"])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "</s>", "pad_token": "<pad>"})
    )


def test_hugging_face_tokenizer_loads_from_a_local_directory(tmp_path) -> None:
    pytest.importorskip("tokenizers", reason="the hf extra (pip install bridge-train[hf])")
    _save_word_level_tokenizer(tmp_path / "tok")
    tok = build_tokenizer(
        TokenizerConfig(
            tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "tok")
        )
    )
    assert isinstance(tok, HuggingFaceTokenizer)
    assert tok.tokenize("hello bridge world") == [3, 5, 4]
    assert tok.detokenize([3, 5, 4]) == "hello bridge world"
    assert (tok.eod, tok.pad, tok.vocab_size) == (1, 2, 6)
    assert tok.unique_identifiers["path"] == str((tmp_path / "tok").resolve())


def test_hugging_face_tokenizer_errors_name_the_directory_and_the_extra(
    tmp_path, monkeypatch
) -> None:
    (tmp_path / "empty").mkdir()
    if "tokenizers" in sys.modules or _has_tokenizers():
        with pytest.raises(FileNotFoundError, match=r"has no tokenizer.json"):
            HuggingFaceTokenizer(tmp_path / "empty")
        with pytest.raises(FileNotFoundError, match=r"is not a directory"):
            HuggingFaceTokenizer(tmp_path / "missing")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if the extra were not installed
    with pytest.raises(ImportError, match=r"pip install 'bridge-train\[hf\]'"):
        HuggingFaceTokenizer(tmp_path / "empty")


def _has_tokenizers() -> bool:
    import importlib.util

    return importlib.util.find_spec("tokenizers") is not None


def test_preprocess_command_with_a_hugging_face_tokenizer_directory(tmp_path, capsys) -> None:
    pytest.importorskip("tokenizers", reason="the hf extra (pip install bridge-train[hf])")
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from bridge.train.data.preprocess import main

    _save_word_level_tokenizer(tmp_path / "tok")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        json.dumps({"text": "hello bridge world"}) + "\n" + json.dumps({"text": "world"}) + "\n",
        encoding="utf-8",
    )
    prefix = tmp_path / "data" / "corpus"
    argv = ["--input", str(corpus), "--output-prefix", str(prefix)]
    hf = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "tok")]
    assert main([*argv, *hf]) == 0
    assert "wrote 2 documents" in capsys.readouterr().out
    dataset = IndexedDataset(str(prefix))
    # word ids from the saved vocabulary, each document closed by the tokenizer's eos (1)
    assert [dataset[i].tolist() for i in range(len(dataset))] == [[3, 5, 4, 1], [4, 1]]
    # a directory without tokenizer.json is named before anything is written
    (tmp_path / "empty").mkdir()
    other = ["--output-prefix", str(tmp_path / "other")]
    hf_empty = [
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        str(tmp_path / "empty"),
    ]
    assert main(["--input", str(corpus), *other, *hf_empty]) == 1
    assert "has no tokenizer.json" in capsys.readouterr().err
    assert not list(tmp_path.glob("other*"))
