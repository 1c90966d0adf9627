"""Datasets through megatron's builder (mock and real), iterators, and the shared cache."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from bridge.config import GPTDatasetConfig
from bridge.train import GlobalState, TrainState
from bridge.train.data import (
    ByteLevelTokenizer,
    build_gpt_dataset_config,
    build_train_valid_test_data_iterators,
    build_train_valid_test_datasets,
    preprocess_data,
    train_valid_test_num_samples,
)
from bridge.train.engine import MegatronEngine
from bridge.train.loop.bare_loop import train_steps
from bridge.train.testing import (
    tiny_dist_config,
    tiny_gpt_provider,
    tiny_mock_dataset_config,
    tiny_optimizer_config,
    tiny_scheduler_config,
    tiny_train_config,
)
from core_utils.testing import run_distributed


def _real_config(blend=None, blend_per_split=None, **overrides) -> GPTDatasetConfig:
    values: dict[str, Any] = {
        "random_seed": 7,
        "sequence_length": 16,
        "reset_position_ids": False,
        "reset_attention_mask": False,
        "eod_mask_loss": False,
        "num_workers": 0,
        "create_attention_mask": True,
        "dataloader_type": "single",
    }
    if blend is not None:
        values.update(blend=blend, split="8,2,0")
    if blend_per_split is not None:
        values.update(blend_per_split=blend_per_split)
    values.update(overrides)
    return GPTDatasetConfig(**values)


def test_sample_counts_follow_megatron() -> None:
    train = tiny_train_config(train_iters=10, global_batch_size=8, eval_iters=2, eval_interval=5)
    assert train_valid_test_num_samples(train) == (80, 3 * 2 * 8, 2 * 8)
    assert train_valid_test_num_samples(tiny_train_config(eval_iters=0)) == (20, 0, 0)
    with pytest.raises(ValueError, match=r"global_batch_size"):
        train_valid_test_num_samples(type("T", (), {"global_batch_size": None})())


def test_missing_data_path_is_named_with_its_field_before_anything_runs(tmp_path) -> None:
    tok = ByteLevelTokenizer()
    with pytest.raises(FileNotFoundError) as info:
        build_gpt_dataset_config(_real_config(blend=[[str(tmp_path / "nope")], None]), tok)
    assert "dataset.blend" in str(info.value) and "nope.bin" in str(info.value)
    per_split = [[[str(tmp_path / "also_missing")], None], None, None]
    with pytest.raises(FileNotFoundError, match=r"dataset.blend_per_split\[train\].*also_missing"):
        build_gpt_dataset_config(_real_config(blend_per_split=per_split), tok)


def _single_rank(
    rank: int, world: int, prefix: str, other_prefix: str, documents: list[str]
) -> dict:
    from bridge.train.engine.initialize import initialize_distributed

    provider = tiny_gpt_provider(vocab_size=258)
    initialize_distributed(provider, tiny_dist_config())
    tok = ByteLevelTokenizer()
    out: dict = {}

    # mock data, cyclic iterators
    train = tiny_train_config(
        train_iters=3, global_batch_size=4, micro_batch_size=2, eval_iters=1, eval_interval=2
    )
    mock = tiny_mock_dataset_config(dataloader_type="cyclic")
    datasets = build_train_valid_test_datasets(mock, tok, train_valid_test_num_samples(train))
    state = TrainState()
    its = build_train_valid_test_data_iterators(datasets, mock, train, state)
    assert its[0] is not None and its[1] is not None
    batch = next(its[0])
    out["mock_keys"] = sorted(batch)
    out["mock_shape"] = tuple(batch["tokens"].shape)
    out["flags"] = (state.do_train, state.do_valid, state.do_test)
    out["valid_many"] = len(list(itertools.islice(its[1], 50)))  # cyclic: never runs out
    workers = build_train_valid_test_data_iterators(
        datasets,
        tiny_mock_dataset_config(dataloader_type="cyclic", num_workers=2),
        train,
        TrainState(),
    )
    again = build_train_valid_test_data_iterators(datasets, mock, train, TrainState())
    assert workers[0] is not None and again[0] is not None
    out["workers_same"] = all(
        torch.equal(a["tokens"], b["tokens"])
        for a, b in zip(itertools.islice(workers[0], 5), itertools.islice(again[0], 5), strict=True)
    )

    # real data: samples are windows over documents separated by <eod>
    config = _real_config(blend=[[prefix], None])
    train = tiny_train_config(
        train_iters=4, global_batch_size=4, micro_batch_size=2, eval_iters=1, eval_interval=2
    )
    datasets = build_train_valid_test_datasets(config, tok, train_valid_test_num_samples(train))
    out["split_sizes"] = [None if d is None else len(d) for d in datasets]
    state = TrainState()
    train_it, valid_it, test_it = build_train_valid_test_data_iterators(
        datasets, config, train, state
    )
    out["test_it"] = test_it is None
    assert train_it is not None and valid_it is not None
    texts, shifted = [], True
    for batch in itertools.islice(train_it, 4):
        tokens, labels = batch["tokens"], batch["labels"]
        shifted &= torch.equal(tokens[:, 1:], labels[:, :-1])
        texts += [row.tolist() for row in tokens]
    out["texts"], out["shifted"] = texts, bool(shifted)
    out["mask_shape"] = tuple(batch["attention_mask"].shape)
    out["valid_repeats"] = len(list(itertools.islice(valid_it, 20)))  # "single": valid restarts

    # two datasets blended by weight, and one dataset per split
    blend = _real_config(blend=[[prefix, other_prefix], [0.5, 0.5]])
    both = build_train_valid_test_datasets(blend, tok, (64, 8, 0))
    blended_text = "".join(tok.detokenize(both[0][i]["tokens"].tolist()) for i in range(64))
    out["blend_sources"] = ("quick" in blended_text, "ZZZ" in blended_text)
    per_split = _real_config(blend_per_split=[[[prefix], None], [[other_prefix], None], None])
    split_ds = build_train_valid_test_datasets(per_split, tok, (16, 8, 0))
    out["per_split_valid_text"] = tok.detokenize(split_ds[1][0]["tokens"].tolist())
    out["per_split_test"] = split_ds[2] is None

    # training reads these tokens: a few steps on the byte-level corpus
    engine = MegatronEngine()
    engine.initialize_distributed(provider, tiny_dist_config())
    model = engine.setup_model(provider)
    optimizer, scheduler = engine.setup_optimizer(
        model, tiny_optimizer_config(lr=3e-3), tiny_scheduler_config(lr_warmup_iters=0), train
    )
    global_state = GlobalState()
    train_it, _, _ = build_train_valid_test_data_iterators(
        datasets, config, train, global_state.train_state
    )
    assert train_it is not None
    result = train_steps(
        engine,
        model,
        optimizer,
        scheduler,
        train_it,
        train_iters=4,
        global_batch_size=4,
        micro_batch_size=2,
        seq_length=16,
        train_state=global_state.train_state,
    )
    out["losses"] = result.losses
    out["tokens_per_step"] = result.num_tokens
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, corpus_documents) -> tuple[str, str, list[str]]:
    root = tmp_path_factory.mktemp("corpus")
    tok = ByteLevelTokenizer()
    # short documents as well, so some fit whole inside a 16-token sample
    documents = [*corpus_documents, "tiny doc", "hi", "a b c"]
    (root / "docs.txt").write_text("\n".join(documents * 6) + "\n", encoding="utf-8")
    (root / "other.txt").write_text("ZZZ other source ZZZ\n" * 30, encoding="utf-8")
    main = preprocess_data([root / "docs.txt"], root / "docs", tok, split_lines=True)
    other = preprocess_data([root / "other.txt"], root / "other", tok, split_lines=True)
    return main.output_prefix, other.output_prefix, documents


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_mock_and_real_datasets_iterators_and_training_read_the_right_tokens(corpus) -> None:
    prefix, other, documents = corpus
    (out,) = run_distributed(_single_rank, 1, prefix, other, documents, timeout=280)
    assert out["mock_keys"] == [
        "attention_mask",
        "labels",
        "loss_mask",
        "position_ids",
        "tokens",
    ] or out["mock_keys"] == ["labels", "loss_mask", "position_ids", "tokens"]
    assert out["mock_shape"] == (2, 16)
    assert out["flags"] == (True, True, True)
    assert out["valid_many"] == 50
    assert out["workers_same"]  # worker processes deliver the same batches in the same order
    assert out["split_sizes"][0] >= 16 and out["split_sizes"][2] is None and out["test_it"]
    assert out["shifted"]
    assert out["mask_shape"] == (2, 1, 16, 16)
    assert out["valid_repeats"] == 20
    tok = ByteLevelTokenizer()
    encoded = [doc.encode("utf-8") for doc in documents]
    whole_documents_seen = 0
    for ids in out["texts"]:
        pieces = [
            bytes(group)
            for is_eod, group in itertools.groupby(ids, lambda i: i == tok.eod)
            if not is_eod
        ]
        # every run of bytes between EODs is part of a document (windows may cut the ends) ...
        assert all(any(piece in doc for doc in encoded) for piece in pieces), ids
        # ... and a run framed by EODs on both sides detokenizes to a whole document
        for inner in _framed_runs(ids, tok.eod):
            assert tok.detokenize(inner) in documents
            whole_documents_seen += 1
    assert whole_documents_seen > 0
    assert out["blend_sources"] == (True, True)
    assert "ZZZ" in out["per_split_valid_text"] and out["per_split_test"]
    assert all(n == 4 * 16 for n in out["tokens_per_step"])
    assert all(torch.isfinite(torch.tensor(out["losses"])))
    assert out["losses"][-1] < out["losses"][0]


def _framed_runs(ids: list[int], eod: int) -> list[list[int]]:
    """Runs of ids with an EOD right before and right after them."""
    positions = [i for i, t in enumerate(ids) if t == eod]
    return [ids[a + 1 : b] for a, b in itertools.pairwise(positions) if b > a + 1]


def _shared_cache(rank: int, world: int, prefix: str, cache: str) -> dict:
    from megatron.core import parallel_state

    from bridge.train.engine.initialize import initialize_distributed

    provider = tiny_gpt_provider(vocab_size=258)
    initialize_distributed(provider, tiny_dist_config())
    tok = ByteLevelTokenizer()
    config = _real_config(blend=[[prefix], None], path_to_cache=cache)
    datasets = build_train_valid_test_datasets(config, tok, (32, 8, 0))
    first = datasets[0][0]["tokens"].tolist()
    train = tiny_train_config(train_iters=2, global_batch_size=4, micro_batch_size=1)
    its = build_train_valid_test_data_iterators(datasets, config, train, TrainState())
    assert its[0] is not None
    mine = [next(its[0])["tokens"][0].tolist() for _ in range(4)]
    return {
        "first": first,
        "mine": mine,
        "dp": (
            parallel_state.get_data_parallel_rank(),
            parallel_state.get_data_parallel_world_size(),
        ),
        "all": [datasets[0][i]["tokens"].tolist() for i in range(8)],
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_ranks_share_the_dataset_cache_and_split_samples_by_rank(
    corpus, tmp_path: Path
) -> None:
    prefix, _, _ = corpus
    cache = tmp_path / "cache"
    r0, r1 = run_distributed(_shared_cache, 2, prefix, str(cache), timeout=280)
    assert r0["first"] == r1["first"] and r0["all"] == r1["all"]
    assert list(cache.rglob("*.npy")), "rank 0 wrote the index cache"
    assert (r0["dp"], r1["dp"]) == ((0, 2), (1, 2))
    # global stream position k goes to rank (k // 1) % 2 with micro-batch 1
    stream = r0["all"]
    assert r0["mine"] == [stream[0], stream[2], stream[4], stream[6]]
    assert r1["mine"] == [stream[1], stream[3], stream[5], stream[7]]
