"""``bridge-train --eval-only`` and the ``samples`` section, through the command (CPU).

A tiny GPT (mock data, dropout on, megatron engine) trains 4 iterations with validation at 2
and 4 and checkpoints at both; the same run with sample completions (sampled, not greedy)
logs the same losses bit for bit and writes the completions to TensorBoard's text dashboard.
``--eval-only`` on each checkpoint reports the validation loss the run logged at that
iteration, bit for bit; ``--eval-data`` evaluates a text file and an SFT JSONL on every
token once, equal to a direct computation with the loaded model. One forked rank runs it
all.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from core_utils.testing import run_distributed

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

COMMON = [
    "--no-print-config",
    "train.train_iters=4",
    "train.eval_interval=2",
    "train.eval_iters=2",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.seq_length=32",
    "model.hidden_dropout=0.1",
    "model.attention_dropout=0.1",
    "logger.log_interval=1",
    "scheduler.lr_warmup_iters=1",
]
SAMPLES = [
    "samples.prompts=['1 2 3','40 41 42 43 44']",
    "samples.max_new_tokens=6",
    "samples.greedy=false",
    "samples.temperature=0.9",
    "samples.top_k=5",
]
TEXT_IDS = [(7 * i) % 120 + 1 for i in range(75)]
SFT_RECORDS = [{"input": "3 4 5", "output": "6 7"}, {"input": "10 11", "output": "12 13 14 15"}]


def _bridge_train(argv: list[str]) -> tuple[int, str]:
    from bridge.train.cli import main

    out = io.StringIO()
    code: Any = 0
    with contextlib.redirect_stdout(out):
        try:
            main(argv)
        except SystemExit as exc:
            code = exc.code
    return int(code or 0), out.getvalue()


def _listing(directory: Path) -> list[tuple[str, int, int]]:
    return sorted(
        (str(p.relative_to(directory)), p.stat().st_size, p.stat().st_mtime_ns)
        for p in directory.rglob("*")
    )


def _records(path: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _direct_loss(ckpt: Path, pieces: Any) -> float:
    """Token-averaged next-token loss of the checkpoint's model over the ``(ids, flags)``
    pieces ``pieces(eod)`` gives (a flag marks a token whose prediction counts), one forward
    each, over the whole (padded) output layer as the trainer's loss is."""
    from bridge.train.generate import load_generation_model

    loaded = load_generation_model(ckpt)
    try:
        chunk = loaded.model[0]
        total, count = 0.0, 0
        for ids, flags in pieces(int(loaded.tokenizer.eod)):
            tokens = torch.tensor([ids[:-1]])
            with torch.no_grad():
                logits = chunk(tokens, torch.arange(tokens.shape[1])[None], None)[0].float()
            losses = torch.nn.functional.cross_entropy(
                logits, torch.tensor(ids[1:]), reduction="none"
            )
            mask = torch.tensor(flags[1:], dtype=torch.float32)
            total += float((losses * mask).sum())
            count += int(mask.sum())
        return total / count
    finally:
        loaded.close()


def _text_pieces(eod: int) -> list[tuple[list[int], list[int]]]:
    ids = [*TEXT_IDS, eod]
    windows = [ids[i : i + 33] for i in range(0, len(ids) - 1, 32)]
    return [(w, [1] * len(w)) for w in windows]


def _sft_pieces(eod: int) -> list[tuple[list[int], list[int]]]:
    pieces = []
    for record in SFT_RECORDS:
        prompt = [int(x) for x in record["input"].split()]
        answer = [int(x) for x in record["output"].split()] + [eod]
        pieces.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    return pieces


def _one_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    base = Path(root)
    out: dict[str, Any] = {}
    run = base / "run"
    out["plain"] = _bridge_train(
        [
            *COMMON,
            f"checkpoint.save={run}",
            "checkpoint.save_interval=2",
            "--metrics-file",
            str(base / "plain.jsonl"),
        ]
    )
    out["samples"] = _bridge_train(
        [
            *COMMON,
            *SAMPLES,
            f"logger.tensorboard_dir={base / 'tb'}",
            "--metrics-file",
            str(base / "samples.jsonl"),
        ]
    )
    out["run_dir_before"] = _listing(run)
    out["eval4"] = _bridge_train(
        ["--eval-only", f"checkpoint.load={run}", "--metrics-file", str(base / "eval4.jsonl")]
    )
    out["eval2"] = _bridge_train(
        [
            "--eval-only",
            f"checkpoint.load={run / 'iter_0000002'}",
            "--metrics-file",
            str(base / "eval2.jsonl"),
        ]
    )
    text = base / "ids.txt"
    text.write_text(" ".join(map(str, TEXT_IDS)))
    out["eval_text"] = _bridge_train(
        [
            "--eval-only",
            f"checkpoint.load={run}",
            "--eval-data",
            str(text),
            "--metrics-file",
            str(base / "eval_text.jsonl"),
        ]
    )
    sft = base / "sft.jsonl"
    sft.write_text("".join(json.dumps(r) + "\n" for r in SFT_RECORDS))
    out["eval_sft"] = _bridge_train(
        [
            "--eval-only",
            f"checkpoint.load={run}",
            "--eval-data",
            str(sft),
            "--metrics-file",
            str(base / "eval_sft.jsonl"),
        ]
    )
    out["refused"] = _bridge_train(["--eval-only", "train.train_iters=2"])
    out["run_dir_after"] = _listing(run)
    out["text_expected"] = _direct_loss(run, _text_pieces)
    out["sft_expected"] = _direct_loss(run, _sft_pieces)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("eval_only")
    (single,) = run_distributed(_one_rank, 1, str(root), timeout=800)
    return {"root": root, **single}


def _value(records: list[dict[str, float]], tag: str, step: int) -> float:
    (value,) = [r[tag] for r in records if r["step"] == step and tag in r]
    return value


def test_samples_do_not_change_training(runs: dict[str, Any]) -> None:
    assert runs["plain"][0] == 0 and runs["samples"][0] == 0
    root: Path = runs["root"]
    plain, sampled = _records(root / "plain.jsonl"), _records(root / "samples.jsonl")
    for step in (1, 2, 3, 4):
        assert _value(plain, "lm loss", step) == _value(sampled, "lm loss", step)
    for step in (2, 4):
        assert _value(plain, "lm loss validation", step) == _value(
            sampled, "lm loss validation", step
        )
    assert "samples at iteration 2:" in runs["samples"][1]
    assert "samples at iteration 4:" in runs["samples"][1]


def test_samples_reach_tensorboard_as_text(runs: dict[str, Any]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(runs["root"] / "tb"), size_guidance={"tensors": 0})
    accumulator.Reload()
    assert "samples/text_summary" in accumulator.Tags()["tensors"]
    events = accumulator.Tensors("samples/text_summary")
    assert [e.step for e in events] == [2, 4]
    table = events[0].tensor_proto.string_val[0].decode()
    assert table.startswith("| prompt | completion |") and "| 1 2 3 |" in table


@pytest.mark.parametrize("step", [2, 4])
def test_eval_only_reports_the_logged_validation_loss(runs: dict[str, Any], step: int) -> None:
    code, console = runs[f"eval{step}"]
    assert code == 0, console
    root: Path = runs["root"]
    logged = _value(_records(root / "plain.jsonl"), "lm loss validation", step)
    evaluated = _records(root / f"eval{step}.jsonl")
    assert _value(evaluated, "lm loss validation", step) == logged  # bit for bit
    ppl = _value(evaluated, "lm loss validation ppl", step)
    assert ppl == pytest.approx(math.exp(logged), rel=1e-12)
    assert f"validation loss at iteration {step} on validation set" in console
    assert runs["run_dir_before"] == runs["run_dir_after"]  # nothing written there
    assert "test loss at iteration" in console  # the mock data's test split too


@pytest.mark.parametrize(("name", "expected"), [("text", "text_expected"), ("sft", "sft_expected")])
def test_eval_data_evaluates_every_token_once(
    runs: dict[str, Any], name: str, expected: str
) -> None:
    code, console = runs[f"eval_{name}"]
    assert code == 0, console
    records = _records(runs["root"] / f"eval_{name}.jsonl")
    value = _value(records, "lm loss validation", 4)
    assert value == pytest.approx(runs[expected], rel=1e-5, abs=1e-6)


def test_eval_only_without_a_checkpoint_is_refused(runs: dict[str, Any]) -> None:
    code, _ = runs["refused"]
    assert code == 2


def test_eval_only_refuses_what_it_cannot_evaluate(tmp_path: Path) -> None:
    from bridge.config import CheckpointConfig, ConfigContainer, ConfigError
    from bridge.train import T5ModelProvider
    from bridge.train.generate.evaluation import prepare_eval_only
    from bridge.train.models.mimo import MimoModelConfig
    from bridge.train.testing import tiny_config_container

    load = CheckpointConfig(load=str(tmp_path))
    with pytest.raises(ConfigError, match=r"--eval-only: is not supported for MIMO runs"):
        prepare_eval_only(ConfigContainer(model=MimoModelConfig(), checkpoint=load))
    t5 = T5ModelProvider(num_layers=2, hidden_size=32, num_attention_heads=4)
    with pytest.raises(ConfigError, match=r"--eval-data: .* a T5 model is evaluated on its own"):
        prepare_eval_only(ConfigContainer(model=t5, checkpoint=load), eval_data=str(tmp_path))
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(ConfigError, match=r"--eval-data: .*missing.jsonl does not exist"):
        prepare_eval_only(tiny_config_container(checkpoint=load), eval_data=str(missing))


def _train_once(rank: int, world: int, root: str) -> tuple[int, str]:
    base = Path(root)
    return _bridge_train(
        [*COMMON, f"checkpoint.save={base / 'run'}", "--metrics-file", str(base / "train.jsonl")]
    )


def _two_rank_evaluations(rank: int, world: int, root: str) -> dict[str, Any]:
    base = Path(root)
    out = {}
    for name, layout in (("tp2", ["model.tensor_model_parallel_size=2"]), ("dp2", [])):
        out[name] = _bridge_train(
            [
                "--eval-only",
                f"checkpoint.load={base / 'run'}",
                *layout,
                "--metrics-file",
                str(base / f"{name}.jsonl"),
            ]
        )
    return out


@pytest.mark.extended
def test_eval_only_in_other_layouts_reports_the_same_loss(tmp_path: Path) -> None:
    """A checkpoint saved by one process, evaluated with TP=2 and with DP=2 (fp32: within
    1e-6 of the loss the run logged; the sums run in another order)."""
    (trained,) = run_distributed(_train_once, 1, str(tmp_path), timeout=600)
    assert trained[0] == 0, trained[1]
    results = run_distributed(_two_rank_evaluations, 2, str(tmp_path), timeout=600)
    assert all(code == 0 for rank in results for code, _ in rank.values())
    logged = _value(_records(tmp_path / "train.jsonl"), "lm loss validation", 4)
    for name in ("tp2", "dp2"):
        value = _value(_records(tmp_path / f"{name}.jsonl"), "lm loss validation", 4)
        assert value == pytest.approx(logged, rel=1e-6), name


def _family_runs(rank: int, world: int, root: str, recipe: str) -> dict[str, tuple[int, str]]:
    """Train ``recipe`` for 4 iterations (validation and a checkpoint at 4), then
    ``--eval-only`` on the checkpoint."""
    base = Path(root)
    trained = _bridge_train(
        [
            "--no-print-config",
            "--recipe",
            recipe,
            "train.train_iters=4",
            "train.eval_interval=4",
            f"checkpoint.save={base / 'run'}",
            "checkpoint.save_interval=4",
            "--metrics-file",
            str(base / "train.jsonl"),
        ]
    )
    evaluated = _bridge_train(
        [
            "--eval-only",
            f"checkpoint.load={base / 'run'}",
            "--metrics-file",
            str(base / "eval.jsonl"),
        ]
    )
    return {"train": trained, "eval": evaluated}


@pytest.mark.extended
@pytest.mark.parametrize("recipe", ["tiny_t5", "tiny_hybrid"])
def test_eval_only_on_other_families_reports_the_logged_validation_loss(
    tmp_path: Path, recipe: str
) -> None:
    """T5 (encoder-decoder) and hybrid Mamba checkpoints: ``--eval-only`` reports the
    validation loss their training run logged at the checkpoint's iteration, bit for bit."""
    (result,) = run_distributed(_family_runs, 1, str(tmp_path), recipe, timeout=800)
    for name, (code, console) in result.items():
        assert code == 0, (name, console[-2000:])
    logged = _records(tmp_path / "train.jsonl")
    evaluated = _records(tmp_path / "eval.jsonl")
    tags = [t for r in logged if r["step"] == 4 for t in r if t.endswith("validation")]
    assert tags, logged
    for tag in tags:
        assert _value(evaluated, tag, 4) == _value(logged, tag, 4), tag


LORA_PROMPTS = [[1, 2, 3], [40, 41, 42, 43, 44, 45, 46]]


def _lora_generation(rank: int, world: int, root: str) -> dict[str, Any]:
    """A base run, a LoRA run on it (adapter-only checkpoints), then generation from the LoRA
    checkpoint with the adapters merged on load and, as the reference, unmerged."""
    from bridge.train.generate import SamplingOptions, load_generation_model, loading

    base = Path(root)
    out: dict[str, Any] = {
        "base_run": _bridge_train([*COMMON, f"checkpoint.save={base / 'run'}"]),
        "lora_run": _bridge_train(
            [
                *COMMON,
                "peft._target_=bridge.train.peft.LoRA",
                "peft.dim=4",
                "peft.alpha=8",
                "optimizer.lr=0.05",  # adapters far enough from zero to change the logits
                f"checkpoint.pretrained_checkpoint={base / 'run'}",
                f"checkpoint.save={base / 'lora'}",
            ]
        ),
    }
    greedy = SamplingOptions(8, stop_at_eod=False)

    def generate(ckpt: Path) -> tuple[int, list[list[int]], list[torch.Tensor]]:
        loaded = load_generation_model(ckpt)
        try:
            completions = loaded.generator().generate(LORA_PROMPTS, greedy, return_logits=True)
            adapters = sum(1 for m in loaded.model[0].modules() if "adapter" in m._modules)
            return (
                adapters,
                [c.token_ids for c in completions],
                [c.logits for c in completions],
            )
        finally:
            loaded.close()

    out["base"] = generate(base / "run")
    out["merged"] = generate(base / "lora")
    merge = loading.merge_adapters  # the loader's merge step, skipped for the reference
    loading.merge_adapters = lambda model: None
    try:
        out["unmerged"] = generate(base / "lora")
    finally:
        loading.merge_adapters = merge
    out["cli"] = _generate_cli([str(base / "lora"), "--prompt", "1 2 3", "--max-new-tokens", "4"])
    return out


def _generate_cli(argv: list[str]) -> tuple[int, str]:
    from bridge.train.generate import cli

    out = io.StringIO()
    code: Any = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            cli.main([*argv, "--json", "--ignore-eod"])
        except SystemExit as exc:
            code = exc.code
    return int(code or 0), out.getvalue()


@pytest.mark.extended
def test_lora_checkpoint_generates_with_its_adapters_merged(tmp_path: Path) -> None:
    """An adapter-only LoRA checkpoint: bridge-generate loads its base, merges the adapters
    and generates what the model with unmerged adapters generates (logits within 1e-5),
    which is not what the base model computes."""
    (result,) = run_distributed(_lora_generation, 1, str(tmp_path), timeout=800)
    for name in ("base_run", "lora_run"):
        assert result[name][0] == 0, result[name][1][-2000:]
    merged, unmerged, base = result["merged"], result["unmerged"], result["base"]
    assert merged[0] == base[0] == 0 and unmerged[0] > 0  # adapters: folded in, or not
    assert merged[1] == unmerged[1]
    error = max(float((a - b).abs().max()) for a, b in zip(merged[2], unmerged[2], strict=True))
    assert error < 1e-5, error
    change = max(float((a - b).abs().max()) for a, b in zip(merged[2], base[2], strict=True))
    assert change > 1e-2, change
    code, printed = result["cli"]
    assert code == 0
    assert len(json.loads(printed)["token_ids"]) == 4


def _two_rank_samples(rank: int, world: int, root: str) -> dict[str, tuple[int, str]]:
    base = Path(root)
    out = {}
    for layout, extra in (("tp2", ["model.tensor_model_parallel_size=2"]), ("dp2", [])):
        for name, samples in (("plain", []), ("samples", SAMPLES)):
            out[f"{layout}_{name}"] = _bridge_train(
                [
                    *COMMON,
                    *extra,
                    *samples,
                    "--metrics-file",
                    str(base / f"{layout}_{name}.jsonl"),
                ]
            )
    return out


@pytest.mark.extended
def test_samples_do_not_change_training_with_two_ranks(tmp_path: Path) -> None:
    """TP=2 (the ranks generate together) and DP=2 (each replica generates alone): every
    training and validation loss bit for bit equal with and without samples."""
    results = run_distributed(_two_rank_samples, 2, str(tmp_path), timeout=800)
    for rank in results:
        for name, (code, console) in rank.items():
            assert code == 0, (name, console[-2000:])
    assert "samples at iteration 4:" in results[0]["tp2_samples"][1]
    for layout in ("tp2", "dp2"):
        plain = _records(tmp_path / f"{layout}_plain.jsonl")
        sampled = _records(tmp_path / f"{layout}_samples.jsonl")
        for step in (1, 2, 3, 4):
            assert _value(plain, "lm loss", step) == _value(sampled, "lm loss", step), layout
        for step in (2, 4):
            assert _value(plain, "lm loss validation", step) == _value(
                sampled, "lm loss validation", step
            ), layout
