"""Separate validation sets (``dataset.multiple_validation_sets``) and their full pass
(``dataset.full_validation``) through ``pretrain``: each set's logged loss is the loss of
evaluating that set alone, a full pass reads every sample of a set once, two
data-parallel ranks log what one process logs, and a resumed run evaluates the same sets
from where the interrupted one stopped."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from bridge.config import ConfigError, GPTDatasetConfig
from bridge.train.checks.preflight import check_section
from bridge.train.data import ByteLevelTokenizer, preprocess_data
from bridge.train.testing import tiny_config_container
from core_utils.testing import run_distributed

SEQ = 16
GBS = 4


def _dataset(root: str, validation: list[str], **fields: Any) -> GPTDatasetConfig:
    """Train on ``docs``; validate on ``validation`` (prefix names under ``root``); with a
    ``split``, one ``blend`` of the ``validation`` prefixes split three ways instead."""
    base = Path(root)
    prefixes = [str(base / name) for name in validation]
    data: dict[str, Any] = {"blend": (prefixes, None)}
    if "split" not in fields:
        data = {"blend_per_split": [([str(base / "docs")], None), (prefixes, None), None]}
    return GPTDatasetConfig(
        random_seed=7,
        sequence_length=SEQ,
        **data,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        num_workers=0,
        dataloader_type="single",
        path_to_cache=str(base / "cache"),
        **fields,
    )


def _config(root: str, validation: list[str], train_iters: int = 2, **sections: Any) -> Any:
    from bridge.config import TokenizerConfig
    from bridge.train.testing import tiny_gpt_provider, tiny_train_config

    dataset_fields = sections.pop("dataset_fields", {})
    train_fields = {
        "train_iters": train_iters,
        "global_batch_size": GBS,
        "micro_batch_size": 2,
        "eval_iters": 2,
        "eval_interval": 1,
        **sections.pop("train_fields", {}),
    }
    return tiny_config_container(
        model=tiny_gpt_provider(vocab_size=None),
        tokenizer=TokenizerConfig(tokenizer_type="ByteLevelTokenizer"),
        train=tiny_train_config(**train_fields),
        dataset=_dataset(root, validation, **dataset_fields),
        **sections,
    )


def _metrics(path: Path) -> dict[int, dict[str, float]]:
    """Logged validation values by iteration."""
    from bridge.train.metrics import read_metrics_file

    found: dict[int, dict[str, float]] = {}
    for record in read_metrics_file(path):
        values = {k: v for k, v in record.items() if k.startswith("lm loss validation")}
        if values:
            found.setdefault(int(record["step"]), {}).update(values)
    return found


class _Recorder:
    """The forward step, recording the tokens of every micro-batch it reads."""

    def __init__(self) -> None:
        self.tokens: list[list[int]] = []
        self.counted: list[bool] = []  # whether a sample's tokens count in the loss

    def __call__(self, state: Any, data_iterator: Any, model: Any) -> Any:
        from bridge.train.models.gpt_step import forward_step

        recorder = self

        class _Peek:
            def __iter__(self) -> _Peek:
                return self

            def __next__(self) -> Any:
                batch = next(data_iterator)
                recorder.tokens.extend(batch["tokens"].tolist())
                recorder.counted.extend(bool(m.any()) for m in batch["loss_mask"])
                return batch

        return forward_step(state, _Peek(), model)


def _evaluate_only(root: str, validation: list[str], name: str, **fields: Any) -> Any:
    """Evaluate the initial model (``train.skip_train``); the logged values at iteration 0."""
    from bridge.train import pretrain

    cfg = _config(root, validation, train_fields={"skip_train": True}, dataset_fields=fields)
    metrics = Path(root) / f"{name}.jsonl"
    assert pretrain(cfg, metrics_file=metrics) == 0
    return _metrics(metrics)[0]


def _separate_and_alone(rank: int, world: int, root: str) -> dict[str, Any]:
    """Per-set losses of the initial model with two separate sets, each set alone, and a
    full pass over each (with the tokens it read)."""
    from bridge.train import pretrain

    out: dict[str, Any] = {
        "separate": _evaluate_only(
            root, ["docs", "other"], "separate", multiple_validation_sets=True
        ),
    }
    if world == 1:
        out["docs alone"] = _evaluate_only(root, ["docs"], "docs_alone")
        out["other alone"] = _evaluate_only(root, ["other"], "other_alone")
        # One blend split three ways: each prefix's validation split is a set.
        split = {"split": "6,3,1"}
        both = ["docs", "other"]
        out["blend"] = _evaluate_only(root, both, "blend", multiple_validation_sets=True, **split)
        out["blend docs alone"] = _evaluate_only(root, ["docs"], "blend_docs", **split)
        out["blend other alone"] = _evaluate_only(root, ["other"], "blend_other", **split)
    full = {"multiple_validation_sets": True, "full_validation": True}
    recorder = _Recorder()
    cfg = _config(root, ["docs", "other"], train_fields={"skip_train": True}, dataset_fields=full)
    metrics = Path(root) / f"full{world}.jsonl"
    assert pretrain(cfg, recorder, metrics_file=metrics) == 0
    out["full"] = _metrics(metrics)[0]
    out["full tokens"] = recorder.tokens
    out["full counted"] = recorder.counted
    return out


def _resume(rank: int, world: int, root: str) -> dict[str, Any]:
    """Validation every iteration: 3 iterations straight, and stopped after 2 then resumed;
    then the iteration-2 checkpoint evaluated alone (``--eval-only``)."""
    from bridge.config import CheckpointConfig
    from bridge.train import pretrain

    base = Path(root)
    separate = {"multiple_validation_sets": True}
    straight = _config(root, ["docs", "other"], 3, dataset_fields=separate)
    assert pretrain(straight, metrics_file=base / "straight.jsonl") == 0
    save = CheckpointConfig(save=str(base / "ckpt"), save_interval=2)
    # The same run (its length sizes the datasets and the LR schedule), stopped after 2.
    first = _config(
        root,
        ["docs", "other"],
        3,
        dataset_fields=separate,
        checkpoint=save,
        train_fields={"exit_interval": 2},
    )
    assert pretrain(first, metrics_file=base / "first.jsonl") == 0
    load = CheckpointConfig(save=str(base / "ckpt"), load=str(base / "ckpt"), save_interval=2)
    resumed = _config(root, ["docs", "other"], 3, dataset_fields=separate, checkpoint=load)
    assert pretrain(resumed, metrics_file=base / "resumed.jsonl") == 0
    # --eval-only on the iteration-2 checkpoint: the validation that run logged there.
    from bridge.train.generate.evaluation import evaluate_checkpoint, prepare_eval_only

    checkpoint = CheckpointConfig(load=str(base / "ckpt" / "iter_0000002"))
    evaluation = _config(root, ["docs", "other"], 3, dataset_fields=separate, checkpoint=checkpoint)
    results = evaluate_checkpoint(evaluation, prepare_eval_only(evaluation))
    return {
        "straight": _metrics(base / "straight.jsonl"),
        "resumed": _metrics(base / "resumed.jsonl"),
        "eval only": {f"lm loss {split}": losses["lm loss"] for split, losses in results.items()},
    }


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``docs`` (English lines) and ``other`` (one repeated odd line): different content."""
    root = tmp_path_factory.mktemp("validation_sets")
    tok = ByteLevelTokenizer()
    lines = [f"line {i} of the first corpus, about nothing much at all" for i in range(39)]
    (root / "docs.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (root / "other.txt").write_text("ZZZ qq 0101 ZZZ xx\n" * 25, encoding="utf-8")
    tokens = {}
    for name in ("docs", "other"):
        preprocess_data([root / f"{name}.txt"], root / name, tok, split_lines=True)
        tokens[name] = _token_count(str(root / name))
    return {"root": str(root), "tokens": tokens}


def _token_count(prefix: str) -> int:
    from bridge.train.data.file_checks import read_sequence_lengths

    return int(read_sequence_lengths(prefix).sum())


@pytest.fixture(scope="module")
def evaluated(corpora: dict[str, Any]) -> dict[str, Any]:
    (one,) = run_distributed(_separate_and_alone, 1, corpora["root"], timeout=280)
    return one


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_each_set_is_logged_under_its_name_with_its_own_loss(evaluated: dict[str, Any]) -> None:
    separate = evaluated["separate"]
    assert set(separate) == {"lm loss validation docs", "lm loss validation other"}
    # Each set's loss is that of evaluating the set alone (same samples, same model).
    assert separate["lm loss validation docs"] == evaluated["docs alone"]["lm loss validation"]
    assert separate["lm loss validation other"] == evaluated["other alone"]["lm loss validation"]
    # Different content, different losses: the sets were not blended into one.
    assert abs(separate["lm loss validation docs"] - separate["lm loss validation other"]) > 1e-3
    # The same for the validation splits of one blend.
    blend = evaluated["blend"]
    assert set(blend) == {"lm loss validation docs", "lm loss validation other"}
    assert blend["lm loss validation docs"] == evaluated["blend docs alone"]["lm loss validation"]
    assert blend["lm loss validation other"] == evaluated["blend other alone"]["lm loss validation"]
    assert abs(blend["lm loss validation docs"] - blend["lm loss validation other"]) > 1e-3


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_full_pass_reads_every_sample_of_each_set_once(
    corpora: dict[str, Any], evaluated: dict[str, Any]
) -> None:
    from bridge.train.data import build_train_valid_test_datasets

    root = corpora["root"]
    config = _dataset(root, ["docs", "other"], multiple_validation_sets=True, full_validation=True)
    _, valid, _ = build_train_valid_test_datasets(config, ByteLevelTokenizer(), (8, 8, 0))
    expected: list[list[int]] = []
    counted: list[bool] = []
    for name, dataset in zip(valid.names, valid.datasets, strict=True):
        # One pass over the set's documents: megatron's sample count for one epoch ...
        assert len(dataset) == (corpora["tokens"][name] - 1) // SEQ
        # ... all read, in order, once: ceil(len / GBS) global batches, the last one
        # filled up with copies of the first sample that count for nothing.
        batches = -(-len(dataset) // GBS)
        padding = batches * GBS - len(dataset)
        assert padding > 0  # the last global batch is incomplete
        expected += [dataset[i]["tokens"].tolist() for i in range(len(dataset))]
        expected += [dataset[0]["tokens"].tolist()] * padding
        counted += [True] * len(dataset) + [False] * padding
    assert evaluated["full tokens"] == expected
    assert evaluated["full counted"] == counted
    assert set(evaluated["full"]) == {"lm loss validation docs", "lm loss validation other"}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_data_parallel_ranks_log_the_same_per_set_losses(
    corpora: dict[str, Any], evaluated: dict[str, Any]
) -> None:
    results = run_distributed(_separate_and_alone, 2, corpora["root"], timeout=280)
    last = results[-1]  # the last rank logs
    for kind in ("separate", "full"):
        assert set(last[kind]) == set(evaluated[kind])
        for tag, value in evaluated[kind].items():
            assert last[kind][tag] == pytest.approx(value, rel=1e-5, abs=1e-6), (kind, tag)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_resumed_run_and_eval_only_evaluate_the_same_sets_where_the_run_stopped(
    corpora: dict[str, Any],
) -> None:
    (out,) = run_distributed(_resume, 1, corpora["root"], timeout=280)
    straight, resumed = out["straight"], out["resumed"]
    assert sorted(straight) == [1, 2, 3] and sorted(resumed) == [3]
    assert set(straight[3]) == {"lm loss validation docs", "lm loss validation other"}
    # Same sets, same samples (each set continued from the checkpointed position).
    assert resumed[3] == straight[3]
    # An evaluation-only run of the iteration-2 checkpoint evaluates each set where the
    # run's own validation at iteration 2 began.
    assert out["eval only"] == straight[2]


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"full_validation": True}, "full_validation", "got true without"),
        (
            {"multiple_validation_sets": True, "mock": True, "blend_per_split": None},
            "multiple_validation_sets",
            "mock",
        ),
        (
            {"multiple_validation_sets": True, "blend": True, "split": "9,0,1"},
            "multiple_validation_sets",
            "no validation split in dataset.split",
        ),
        (
            {"multiple_validation_sets": True, "validation": None},
            "multiple_validation_sets",
            "no validation entry",
        ),
        (
            {"multiple_validation_sets": True, "dataloader_type": "external"},
            "multiple_validation_sets",
            "external",
        ),
    ],
)
def test_what_cannot_be_separate_is_refused_naming_the_field(
    corpora: dict[str, Any], fields: dict[str, Any], field: str, message: str
) -> None:
    root = corpora["root"]
    fields = dict(fields)
    dataset = _dataset(root, ["docs", "other"])
    if fields.pop("validation", True) is None:
        assert dataset.blend_per_split is not None
        dataset.blend_per_split[1] = None
    if fields.pop("blend", False):
        fields.update(blend=([str(Path(root) / "docs")], None), blend_per_split=None)
    cfg = _config(root, ["docs", "other"])
    cfg.dataset = dataclasses.replace(dataset, **fields)
    with pytest.raises(ConfigError) as info:
        check_section(vars(cfg), "dataset", 1, cuda_available=False)
    assert str(info.value).startswith(f"dataset.{field}: got true")
    assert message in str(info.value)


def test_separate_validation_sets_of_blend_per_split_pass_the_checks(
    corpora: dict[str, Any],
) -> None:
    dataset = _dataset(
        corpora["root"], ["docs", "other"], multiple_validation_sets=True, full_validation=True
    )
    cfg = _config(corpora["root"], ["docs", "other"])
    cfg.dataset = dataset
    check_section(vars(cfg), "dataset", 1, cuda_available=False)


@pytest.mark.parametrize(
    ("recipe", "message"),
    [
        ("tiny_gpt", "got true with mock data"),
        ("tiny_t5", "got true with T5 span-corruption data"),
        ("sft", "unknown field of FinetuningDatasetConfig"),
    ],
)
def test_the_command_refuses_separate_sets_it_cannot_build(
    capsys: pytest.CaptureFixture[str], recipe: str, message: str
) -> None:
    from bridge.train.cli import EXIT_CONFIG_ERROR, main

    with pytest.raises(SystemExit) as info:
        main(["--recipe", recipe, "--dry-run", "dataset.multiple_validation_sets=true"])
    assert info.value.code == EXIT_CONFIG_ERROR
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1
    assert errors[0].startswith("bridge-train: error: dataset.multiple_validation_sets: ")
    assert message in errors[0]


def test_a_set_is_named_by_its_file_name_or_by_its_index_when_names_repeat() -> None:
    from bridge.train.data.validation_sets import validation_set_names

    assert validation_set_names(["/data/wiki", "/data/code"]) == ("wiki", "code")
    assert validation_set_names(["/a/text", "/b/text", "/b/code"]) == ("0", "1", "2")
