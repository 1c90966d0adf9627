"""T5 span corruption over indexed data: the sentinel tokenizer, the config checks, and
megatron's ``T5MaskedWordPieceDataset`` samples read from a corpus written by
``bridge-preprocess-data`` (sentinels in the encoder input match the decoder targets, the
masks cover exactly the tokens)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bridge.config import ConfigError, TokenizerConfig
from bridge.train.cli import EXIT_CONFIG_ERROR, main
from bridge.train.data.preprocess import preprocess_data
from bridge.train.data.t5_datasets import T5DatasetConfig, check_t5_data_config, max_t5_spans
from bridge.train.data.t5_tokenizer import T5Tokenizer
from bridge.train.data.tokenizers import ByteLevelTokenizer, NullTokenizer
from bridge.train.models.family import family_tokenizer
from core_utils.testing import run_distributed

SEQ, SEQ_DEC, SENTINELS = 48, 24, 8


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("t5corpus")
    lines = [
        f"story {i}: the {['red', 'blue', 'green'][i % 3]} fox jumps over dog {i}."
        for i in range(60)
    ]
    (root / "docs.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return preprocess_data(
        [root / "docs.txt"], root / "docs", ByteLevelTokenizer(), split_lines=True
    ).output_prefix


def _config(prefix: str, **overrides: Any) -> T5DatasetConfig:
    values: dict[str, Any] = {
        "random_seed": 5,
        "sequence_length": SEQ,
        "sequence_length_dec": SEQ_DEC,
        "blend": ([prefix], None),
        "split": "9,1,0",
        "path_to_cache": str(Path(prefix).parent / "cache"),
    }
    values.update(overrides)
    return T5DatasetConfig(**values)


def test_sentinel_tokenizer_reuses_the_base_ids_and_adds_the_rest() -> None:
    base = ByteLevelTokenizer(
        special_tokens=["<cls>"], vocab_extra_ids=3
    )  # 256 bytes, <cls>, <eod>, <pad>, 3 sentinels
    tok = T5Tokenizer(base, 3)
    assert tok.additional_special_tokens_ids == [
        base.special_token_id(f"<extra_id_{i}>") for i in range(3)
    ]
    assert tok.cls == base.special_token_id("<cls>")
    assert (tok.bos, tok.sep, tok.mask) == (
        base.vocab_size,
        base.vocab_size + 1,
        base.vocab_size + 2,
    )
    assert tok.vocab_size == base.vocab_size + 3
    assert (tok.eos, tok.eod, tok.pad) == (base.eod, base.eod, base.pad)
    assert len(tok.inv_vocab) == tok.vocab_size and tok.inv_vocab[ord("a")] == "a"
    assert tok.detokenize([ord("h"), ord("i"), tok.bos, tok.additional_special_tokens_ids[1]]) == (
        "hi<bos><extra_id_1>"
    )
    assert tok.unique_identifiers != T5Tokenizer(base, 2).unique_identifiers  # cache keys differ

    null = T5Tokenizer(NullTokenizer(100), 4)  # has nothing: every token is added, pad too
    assert null.additional_special_tokens_ids == [100, 101, 102, 103]
    assert (null.bos, null.cls, null.sep, null.mask, null.pad, null.vocab_size) == (
        104,
        105,
        106,
        107,
        108,
        109,
    )
    with pytest.raises(ValueError, match="vocab_extra_ids must be >= 1"):
        T5Tokenizer(base, 0)


def test_config_refuses_what_megatron_cannot_serve(corpus: str) -> None:
    cfg = _config(corpus)
    spans = max_t5_spans(SEQ, 0.15)
    assert spans == 6
    check_t5_data_config(
        cfg, TokenizerConfig(tokenizer_type="ByteLevelTokenizer", vocab_extra_ids=spans)
    )
    with pytest.raises(ConfigError, match=r"tokenizer\.vocab_extra_ids: is 5 .* at least 6"):
        check_t5_data_config(
            cfg, TokenizerConfig(tokenizer_type="ByteLevelTokenizer", vocab_extra_ids=5)
        )
    with pytest.raises(ConfigError, match=r"tokenizer\.tokenizer_type"):
        check_t5_data_config(cfg, None)
    with pytest.raises(ConfigError, match=r"dataset\.sequence_length_dec: is 12 .* 13 decoder"):
        check_t5_data_config(
            _config(corpus, sequence_length_dec=12),
            TokenizerConfig(tokenizer_type="ByteLevelTokenizer", vocab_extra_ids=10),
        )
    with pytest.raises(ConfigError, match=r"\.split: got None; it is required with blend"):
        _config(corpus, split=None)


def test_command_refuses_too_few_sentinels_in_one_line(
    corpus: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(
            [
                "--no-print-config",
                "--recipe",
                "tiny_t5",
                f"dataset.blend=[[{corpus}],null]",
                "dataset.split=9,1,0",
                "tokenizer.tokenizer_type=ByteLevelTokenizer",
                "tokenizer.vocab_size=null",
                "tokenizer.vocab_extra_ids=2",
            ]
        )
    assert info.value.code == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tokenizer.vocab_extra_ids: is 2" in err, err


def _samples(rank: int, world: int, prefix: str) -> dict[str, Any]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from bridge.train.data.t5_datasets import build_t5_datasets

    cfg = _config(prefix)
    tok = family_tokenizer(
        cfg,
        TokenizerConfig(tokenizer_type="ByteLevelTokenizer", vocab_extra_ids=SENTINELS),
        ByteLevelTokenizer(),
    )
    train, valid, test = build_t5_datasets(cfg, tok, (40, 8, 0))
    indexed = IndexedDataset(prefix)
    out: dict[str, Any] = {"type": type(train).__name__, "sizes": (len(train), len(valid), test)}
    samples = []
    for i in range(len(train)):
        s = train[i]
        beg, end, target = (int(x) for x in train.sample_index[i])
        original = np.concatenate([indexed[j] for j in range(beg, end)])[:target]
        samples.append({k: np.asarray(v) for k, v in s.items()} | {"original": original})
    again = train[3]
    out["deterministic"] = all(
        np.array_equal(again[k], samples[3][k]) for k in ("text_enc", "labels")
    )
    out["samples"] = samples
    out["tok"] = {"sentinels": tok.additional_special_tokens_ids, "bos": tok.bos, "eos": tok.eos}
    del indexed
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_megatron_samples_are_well_formed_span_corruption(corpus: str) -> None:
    (out,) = run_distributed(_samples, 1, corpus, timeout=280)
    assert out["type"] == "T5MaskedWordPieceDataset"
    assert out["sizes"][0] >= 40 and out["sizes"][1] >= 8 and out["sizes"][2] is None
    assert out["deterministic"]
    tok = out["tok"]
    sentinels = tok["sentinels"]
    assert len(sentinels) == SENTINELS
    masked_any = False
    for s in out["samples"]:
        enc, dec, labels = s["text_enc"], s["text_dec"], s["labels"]
        assert enc.shape == (SEQ,) and dec.shape == (SEQ_DEC,) and labels.shape == (SEQ_DEC,)
        n_enc, n_dec = int(s["enc_mask"].sum()), int(s["dec_mask"].sum())
        # masks: ones on the tokens, zeros on the padding (token 0 there), loss on the decoder
        assert s["enc_mask"][:n_enc].all() and not s["enc_mask"][n_enc:].any()
        assert s["dec_mask"][:n_dec].all() and not s["dec_mask"][n_dec:].any()
        np.testing.assert_array_equal(s["loss_mask"], s["dec_mask"])
        assert not enc[n_enc:].any() and not dec[n_dec:].any()
        # the decoder input is bos + the targets shifted right; targets end in eos
        assert dec[0] == tok["bos"]
        np.testing.assert_array_equal(labels[: n_dec - 1], dec[1:n_dec])
        assert labels[n_dec - 1] == tok["eos"]
        # sentinels: in order, the same ones in the encoder input and the decoder targets
        enc_sent = [int(t) for t in enc[:n_enc] if t in sentinels]
        dec_sent = [int(t) for t in labels[: n_dec - 1] if t in sentinels]
        assert enc_sent == dec_sent == sentinels[: len(enc_sent)]
        masked_any |= bool(enc_sent)
        # filling each sentinel with its span gives back the original tokens
        spans: dict[int, list[int]] = {}
        current = None
        for t in labels[: n_dec - 1].tolist():
            if t in sentinels:
                current = t
                spans[t] = []
            else:
                assert current is not None
                spans[current].append(t)
        assert all(spans.values())  # no empty span
        rebuilt = [x for t in enc[:n_enc].tolist() for x in (spans[t] if t in sentinels else [t])]
        np.testing.assert_array_equal(rebuilt, s["original"])
    assert masked_any


def test_sentinel_tokenizer_on_a_hugging_face_wordpiece_vocabulary(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers", reason="the hf extra (pip install bridge-train[hf])")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from bridge.train.data.tokenizers import HuggingFaceTokenizer

    vocab = {"[UNK]": 0, "</s>": 1, "<pad>": 2, "<mask>": 3, "jump": 4, "##ing": 5, "fox": 6}
    hf = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(["</s>", "<pad>", "<mask>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    base = HuggingFaceTokenizer(tmp_path, vocab_extra_ids=2)  # adds <extra_id_0>, <extra_id_1>
    tok = T5Tokenizer(base, 2)
    assert tok.additional_special_tokens_ids == [7, 8]  # the vocabulary's own sentinels
    assert tok.mask == 3 and (tok.eos, tok.pad) == (1, 2)
    assert (tok.bos, tok.cls, tok.sep, tok.vocab_size) == (9, 10, 11, 12)
    # word pieces keep megatron's "##" marker, so whole-word masking keeps "jump ##ing" together
    assert tok.inv_vocab[5] == "##ing" and tok.inv_vocab[4] == "jump"
    assert base.tokenize("jumping fox") == [4, 5, 6]
