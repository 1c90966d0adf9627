"""SFT datasets from FinetuningDatasetConfig: rendering, answer-only loss masks, truncation,
cache, order, packing, and the launch checks that refuse what cannot be honoured."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bridge.config import (
    ConfigError,
    FinetuningDatasetConfig,
    PackedSequenceSpecs,
    TokenizerConfig,
)
from bridge.train.checks.preflight import check_config_before_launch
from bridge.train.data.packing import PackedSFTDataset, first_fit_bins
from bridge.train.data.sft import (
    SFTDataset,
    build_sft_datasets,
    chat_generation_prompt,
    check_finetuning_dataset,
    load_tokenized_examples,
    sft_settings,
)
from bridge.train.data.tokenizers import ByteLevelTokenizer
from bridge.train.testing import tiny_config_container, tiny_gpt_provider, tiny_train_config


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def qa_records(count: int, offset: int = 0) -> list[dict[str, Any]]:
    return [{"input": f"Q{i + offset}?", "output": f"A{i + offset}"} for i in range(count)]


@pytest.fixture
def sft_root(tmp_path: Path) -> Path:
    root = tmp_path / "sft"
    root.mkdir()
    write_jsonl(root / "training.jsonl", qa_records(10))
    write_jsonl(root / "validation.jsonl", qa_records(3, 100))
    write_jsonl(root / "test.jsonl", qa_records(2, 200))
    return root


def _config(root: Path, **overrides: Any) -> FinetuningDatasetConfig:
    values: dict[str, Any] = {
        "dataset_root": root,
        "seq_length": 16,
        "num_workers": 0,
        "dataloader_type": "single",
        "pin_memory": False,
    }
    values.update(overrides)
    return FinetuningDatasetConfig(**values)


TOKENIZER = ByteLevelTokenizer()


def test_prompt_tokens_get_no_loss_and_answers_do(sft_root: Path) -> None:
    train, valid, test = build_sft_datasets(_config(sft_root), TOKENIZER, (10, 3, 2))
    assert len(train) == 10 and len(valid) == 3 and len(test) == 2
    sample = valid[0]  # file order: {"input": "Q100?", "output": "A100"}
    text = "Q100?A100"
    ids = [*text.encode(), TOKENIZER.eod]
    n = len(ids) - 1
    assert sample["tokens"][:n].tolist() == ids[:-1]
    assert sample["labels"][:n].tolist() == ids[1:]
    # labels A, 1, 0, 0, <eod> are the answer; everything else (prompt, padding) is masked.
    expected = [0.0] * (len("Q100?") - 1) + [1.0] * (len("A100") + 1) + [0.0] * (16 - n)
    assert sample["loss_mask"].tolist() == expected
    assert sample["position_ids"].tolist() == list(range(16))
    assert (sample["tokens"][n:] == TOKENIZER.pad).all()
    assert "attention_mask" not in sample  # causal attention; padding comes last


def test_chat_records_loss_on_assistant_turns_only(tmp_path: Path) -> None:
    root = tmp_path / "chat"
    root.mkdir()
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ]
    write_jsonl(root / "training.jsonl", [{"messages": messages}])
    train, _, _ = build_sft_datasets(
        _config(root, seq_length=48, do_validation=False, do_test=False), TOKENIZER, (1, 0, 0)
    )
    assert _ is None
    sample = train[0]
    text = "<|system|>\nS\n<|user|>\nhi\n<|assistant|>\nyo\n"
    ids = [*text.encode(), TOKENIZER.eod]
    assert sample["tokens"][: len(ids) - 1].tolist() == ids[:-1]
    scored = [int(t) for t, m in zip(sample["labels"], sample["loss_mask"], strict=True) if m]
    assert scored == [*b"yo\n", TOKENIZER.eod]


class _TemplatedTokenizer(ByteLevelTokenizer):
    """A byte-level tokenizer with a chat template, as a user's Hugging Face wrapper has."""

    def apply_chat_template(
        self, messages: list[dict[str, str]], tokenize: bool, add_generation_prompt: bool = False
    ) -> str:
        assert not tokenize
        text = "".join(f"[{m['role']}] {m['content']};" for m in messages)
        return text + ("[assistant] " if add_generation_prompt else "")


def test_chat_records_use_the_tokenizer_chat_template(tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    tokenizer = _TemplatedTokenizer()
    examples = load_tokenized_examples(tmp_path / "chat.jsonl", tokenizer, sft_settings(None))
    ids, flags = examples.example(0)
    assert ids.tolist() == [*b"[user] hi;[assistant] yo;", tokenizer.eod]
    # Loss on the assistant message's tokens (as the template renders them) and the EOD.
    assert [int(t) for t, f in zip(ids, flags, strict=True) if f] == [
        *b"[assistant] yo;",
        tokenizer.eod,
    ]
    # A generation prompt is the rendered chat and the template's opening of an answer.
    prompt = chat_generation_prompt(tokenizer, messages[:1])
    assert prompt == list(b"[user] hi;[assistant] ")


def test_truncation_policies(tmp_path: Path) -> None:
    root = tmp_path / "long"
    root.mkdir()
    write_jsonl(
        root / "training.jsonl",
        [{"input": "P" * 30, "output": "ans"}, {"input": "p", "output": "short"}],
    )
    common = {"do_validation": False, "do_test": False, "seq_length": 8}
    left = build_sft_datasets(_config(root, **common), TOKENIZER, (2, 0, 0))[0]
    assert isinstance(left, SFTDataset) and len(left.examples) == 2
    ids, flags = left.examples[0]  # the end survives: prompt tail + answer + eod
    assert ids.tolist() == [*b"PPPPPans", TOKENIZER.eod] and flags.sum() == 4
    dropped = build_sft_datasets(
        _config(root, dataset_kwargs={"truncation": "drop"}, **common), TOKENIZER, (2, 0, 0)
    )[0]
    assert dropped.skipped == 1 and len(dropped.examples) == 1
    # Keeping the start leaves the long example without an answer token: skipped too.
    right = build_sft_datasets(
        _config(root, dataset_kwargs={"truncation": "right"}, **common), TOKENIZER, (2, 0, 0)
    )[0]
    assert right.skipped == 1


def test_order_is_seeded_per_epoch_and_resumable(sft_root: Path) -> None:
    cfg = _config(sft_root, do_validation=False, do_test=False)
    a = build_sft_datasets(cfg, TOKENIZER, (25, 0, 0))[0]
    b = build_sft_datasets(cfg, TOKENIZER, (25, 0, 0))[0]
    order = [a.example_index(i) for i in range(len(a))]
    assert len(a) == 30  # three whole epochs
    assert order == [b.example_index(i) for i in range(len(b))]
    for epoch in range(3):  # each epoch is a permutation of all examples, each different
        assert sorted(order[epoch * 10 : epoch * 10 + 10]) == list(range(10))
    assert order[:10] != order[10:20] and order[:10] != list(range(10))
    other = build_sft_datasets(
        _config(sft_root, seed=7, do_validation=False, do_test=False), TOKENIZER, (25, 0, 0)
    )[0]
    assert [other.example_index(i) for i in range(10)] != order[:10]
    limited = build_sft_datasets(
        _config(sft_root, max_train_samples=4, do_validation=False, do_test=False),
        TOKENIZER,
        (8, 0, 0),
    )[0]
    assert len(limited.examples) == 4 and len(limited) == 8


def test_tokenized_cache_is_reused_and_keyed(sft_root: Path, monkeypatch) -> None:
    settings = sft_settings(None)
    cache = sft_root / "cache"
    first = load_tokenized_examples(
        sft_root / "training.jsonl", TOKENIZER, settings, cache_dir=cache
    )
    assert len(list(cache.glob("training-*.npz"))) == 1

    def fail(*_: Any, **__: Any) -> Any:
        raise AssertionError("tokenized again despite the cache")

    monkeypatch.setattr("bridge.train.data.sft._tokenize_file", fail)
    again = load_tokenized_examples(
        sft_root / "training.jsonl", TOKENIZER, settings, cache_dir=cache
    )
    assert np.array_equal(first.tokens, again.tokens)
    assert np.array_equal(first.loss_flags, again.loss_flags)
    monkeypatch.undo()
    # Another template is another cache entry; a corrupt cache is rebuilt, not trusted.
    load_tokenized_examples(
        sft_root / "training.jsonl",
        TOKENIZER,
        sft_settings({"prompt_template": "Question: {input}\n"}),
        cache_dir=cache,
    )
    files = sorted(cache.glob("training-*.npz"))
    assert len(files) == 2
    files[0].write_bytes(b"garbage")
    load_tokenized_examples(sft_root / "training.jsonl", TOKENIZER, settings, cache_dir=cache)
    load_tokenized_examples(
        sft_root / "training.jsonl",
        TOKENIZER,
        sft_settings({"prompt_template": "Question: {input}\n"}),
        cache_dir=cache,
    )
    for path in cache.glob("training-*.npz"):
        with np.load(path) as data:
            assert len(data["offsets"]) == 11


def test_parallel_tokenizing_matches_serial(sft_root: Path) -> None:
    settings = sft_settings(None)
    serial = load_tokenized_examples(sft_root / "training.jsonl", TOKENIZER, settings)
    parallel = load_tokenized_examples(sft_root / "training.jsonl", TOKENIZER, settings, workers=2)
    assert np.array_equal(serial.tokens, parallel.tokens)
    assert np.array_equal(serial.offsets, parallel.offsets)


def test_bad_records_and_options_name_the_problem(sft_root: Path) -> None:
    (sft_root / "bad.jsonl").write_text('{"input": "x"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl line 1: no 'output' key"):
        load_tokenized_examples(sft_root / "bad.jsonl", TOKENIZER, sft_settings(None))
    with pytest.raises(ConfigError, match=r"dataset\.dataset_kwargs\.promt_key"):
        check_finetuning_dataset(_config(sft_root, dataset_kwargs={"promt_key": "q"}))
    with pytest.raises(ConfigError, match=r"dataset\.dataset_kwargs\.truncation"):
        check_finetuning_dataset(_config(sft_root, dataset_kwargs={"truncation": "middle"}))
    assert sft_settings({"cache_dir": sft_root}).cache_dir == sft_root  # a Path, from Python
    for key, value in (("answer_key", ""), ("add_eod", "yes"), ("cache_dir", 5)):
        with pytest.raises(ConfigError, match=rf"dataset\.dataset_kwargs\.{key}: .*got {value!r}"):
            check_finetuning_dataset(_config(sft_root, dataset_kwargs={key: value}))
    (sft_root / "test.jsonl").unlink()
    with pytest.raises(ConfigError, match=r"dataset\.do_test.*set dataset\.do_test=false"):
        check_finetuning_dataset(_config(sft_root))
    with pytest.raises(ConfigError, match=r"dataset\.dataloader_type"):
        check_finetuning_dataset(_config(sft_root, do_test=False, dataloader_type="external"))
    with pytest.raises(ConfigError, match=r"dataset\.dataset_root"):
        check_finetuning_dataset(_config(sft_root / "nowhere"))
    with pytest.raises(ConfigError, match=r"dataset\.dataset_root: is required for finetuning"):
        check_finetuning_dataset(_config(sft_root, dataset_root=None))


def _launch_config(root: Path, **dataset: Any) -> Any:
    packed = dataset.get("packed_sequence_specs") is not None
    return tiny_config_container(
        train=tiny_train_config(micro_batch_size=1 if packed else 2),
        model=tiny_gpt_provider(vocab_size=258),
        tokenizer=TokenizerConfig(tokenizer_type="ByteLevelTokenizer"),
        dataset=_config(root, **dataset),
    )


def test_launch_refuses_what_it_cannot_honour(sft_root: Path) -> None:
    check_config_before_launch(_launch_config(sft_root), world_size=1)
    packed = PackedSequenceSpecs(packed_sequence_size=16, packed_train_data_path="x.npy")
    with pytest.raises(ConfigError, match=r"packed_sequence_specs\.packed_train_data_path"):
        check_config_before_launch(
            _launch_config(sft_root, packed_sequence_specs=packed), world_size=1
        )
    local = _launch_config(
        sft_root, packed_sequence_specs=PackedSequenceSpecs(packed_sequence_size=16)
    )
    check_config_before_launch(local, world_size=1)
    local.model.layer_spec_backend = "local"
    with pytest.raises(ConfigError, match=r"model\.layer_spec_backend"):
        check_config_before_launch(local, world_size=1)


def test_first_fit_bins() -> None:
    assert first_fit_bins([5, 3, 4, 2, 1], 8) == [[0, 1], [2, 3, 4]]
    assert first_fit_bins([8, 8], 8) == [[0], [1]]


def test_packed_samples_keep_examples_apart(sft_root: Path) -> None:
    settings = sft_settings(None)
    examples = load_tokenized_examples(sft_root / "training.jsonl", TOKENIZER, settings)
    packed = PackedSFTDataset(examples, 32, TOKENIZER.pad, num_samples=1, shuffle_seed=None)
    # Q0?A0<eod> is 6 ids = 5 positions; Q1? .. Q9? likewise; six fit in 32.
    assert [len(b) for b in packed.bins] == [6, 4]
    assert packed.useful_tokens() == 50
    sample = packed[0]
    assert sample["position_ids"][:11].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0]
    mask = sample["attention_mask"][0]
    allowed = ~mask
    assert allowed[6, 5] and allowed[6, 6] and not allowed[6, 4] and not allowed[6, 7]
    assert allowed[31, 31]  # padding attends to itself: no empty softmax rows
    assert sample["cu_seqlens"][:8].tolist() == [0, 5, 10, 15, 20, 25, 30, 30]
    unpacked = SFTDataset(examples, 32, TOKENIZER.pad)
    assert sample["loss_mask"][:5].tolist() == unpacked[0]["loss_mask"][:5].tolist()
    assert torch.equal(sample["labels"][5:10], unpacked[1]["labels"][:5])


def test_eval_file_of_text_documents_and_its_refusals(tmp_path: Path) -> None:
    from bridge.train.data.eval_file import TokenWindows, build_eval_file_dataset

    write_jsonl(tmp_path / "docs.jsonl", [{"text": "abc"}, {"text": "de"}])
    windows = build_eval_file_dataset(tmp_path / "docs.jsonl", TOKENIZER, 4)
    # Each document then the EOD, in windows of 4 predicted tokens; loss on every real one.
    stream = [*b"abc", TOKENIZER.eod, *b"de", TOKENIZER.eod]
    assert isinstance(windows, TokenWindows) and len(windows) == 2
    assert windows[0]["labels"].tolist() == stream[1:5]
    assert windows[1]["loss_mask"].tolist() == [1.0, 1.0, 0.0, 0.0]
    write_jsonl(tmp_path / "mixed.jsonl", [{"text": "abc"}, {"body": "de"}])
    with pytest.raises(ValueError, match=r"mixed\.jsonl line 2: needs a 'text' string"):
        build_eval_file_dataset(tmp_path / "mixed.jsonl", TOKENIZER, 4)
    write_jsonl(tmp_path / "other.jsonl", [{"body": "x"}])
    with pytest.raises(ValueError, match=r"other\.jsonl line 1: expected an SFT record"):
        build_eval_file_dataset(tmp_path / "other.jsonl", TOKENIZER, 4)
    (tmp_path / "empty.jsonl").write_text("\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"empty\.jsonl holds no record"):
        build_eval_file_dataset(tmp_path / "empty.jsonl", TOKENIZER, 4)
    with pytest.raises(ValueError, match=r"--eval-data .*missing\.txt does not exist"):
        build_eval_file_dataset(tmp_path / "missing.txt", TOKENIZER, 4)
