"""A Hugging Face MoE model trained through ``bridge-train`` with expert parallelism.

A tiny random Qwen3-MoE (``transformers``, a dense layer among the expert layers) is
imported with ``bridge-convert``; its run config trains it on mock data on the megatron
engine (CPU, gloo). Checked, in three forked process groups:

* 10 steps at EP=2 on two ranks equal 10 steps on one process within 1e-5 per step
  (``lm loss`` from ``--metrics-file``), with the load-balancing loss and the router
  z-loss logged every step and equal too;
* resuming the EP=2 run from its step-5 checkpoint reproduces steps 6-10 bit for bit;
* the trained checkpoint exported with ``bridge-convert`` loads in transformers and gives
  the logits of the trained megatron model (within 1e-5 relative, left-padded batch);
* a LoRA finetune at EP=2 puts adapters on attention and on every expert's MLP; its export
  (adapters folded in) loads in transformers with the logits of base + adapters as trained.

Extended tier: the same for Mixtral, and Qwen3-MoE at EP=2 x TP=2 (with sequence
parallelism, which megatron-core requires for MoE with tensor parallelism) on four ranks.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from bridge.train.metrics import read_metrics_file  # noqa: E402
from core_utils.testing import run_distributed  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(1500)]

ITERS = 10
METRICS = ("lm loss", "load_balancing_loss", "z_loss")
LORA = ("peft._target_=bridge.train.peft.LoRA", "peft.dim=4", "peft.alpha=8")


def _hf_model(family: str, randomized: Any) -> Any:
    torch.manual_seed(0)
    common: dict[str, Any] = {
        "vocab_size": 300,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": False,
    }
    if family == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=32, num_local_experts=4, **common)
        return randomized(transformers.MixtralForCausalLM(config))
    config = transformers.Qwen3MoeConfig(
        intermediate_size=96,
        moe_intermediate_size=32,
        head_dim=16,
        num_experts=4,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        **common,
    )
    return randomized(transformers.Qwen3MoeForCausalLM(config))


def _overrides(root: Path, name: str, *extra: str, iters: int = ITERS) -> list[str]:
    return [
        "--config",
        str(root / "ckpt" / "iter_0000000" / "run_config.yaml"),
        "--metrics-file",
        str(root / f"{name}.jsonl"),
        "--no-print-config",
        f"checkpoint.save={root / name}",
        f"checkpoint.save_interval={min(5, iters)}",
        f"train.train_iters={iters}",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "train.eval_iters=0",
        f"scheduler.lr_warmup_iters={2 if iters > 2 else 0}",
        "logger.log_interval=5",
        "logger.tensorboard_log_interval=1",
        "model.seq_length=16",
        "dataset.sequence_length=16",
        "model.moe_z_loss_coeff=0.001",
        *extra,
    ]


def _train(argv: list[str]) -> Any:
    from bridge.train.cli import main

    try:
        return main(argv)
    except SystemExit as exc:  # the command's main exits with the run's code
        return exc.code


def _import_and_train_one_process(rank: int, world: int, root: str) -> dict[str, Any]:
    from bridge.train.convert import cli

    base = Path(root)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli.main(["import", str(base / "hf"), str(base / "ckpt"), "--ep", "2", "--quiet"])
    assert code == 0, err.getvalue()
    # The import recorded EP=2 (the layout it was imported for); one process runs EP=1.
    return {"single": _train(_overrides(base, "single", "model.expert_model_parallel_size=1"))}


def _train_expert_parallel(rank: int, world: int, root: str, extra: list[str]) -> dict[str, Any]:
    base = Path(root)
    layout = ["model.expert_model_parallel_size=2", *extra]
    out = {"ep": _train(_overrides(base, "ep", *layout))}
    out["resumed"] = _train(
        _overrides(
            base, "resumed", *layout, f"checkpoint.load={base / 'ep'}", "checkpoint.ckpt_step=5"
        )
    )
    if not extra:  # LoRA on attention and on every expert, from the imported weights
        out["lora"] = _train(_overrides(base, "lora", *layout, *LORA, iters=2))
    return out


def _export_and_trainer_logits(
    rank: int, world: int, root: str, logits_of: Any, runs: list[str]
) -> dict[str, Any]:
    """Export each trained run; the trained megatron model's logits on the padded batch
    (a LoRA run: base plus adapters as trained, not merged)."""
    from bridge.config import ConfigContainer
    from bridge.train.checkpointing import find_latest_checkpoint
    from bridge.train.convert import cli
    from bridge.train.convert._runtime import single_process_megatron, single_rank_copy
    from bridge.train.convert.exporter import load_model_for_export
    from bridge.train.peft import LoRAAdapter

    base = Path(root)
    out: dict[str, Any] = {}
    for run in runs:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = cli.main(["export", str(base / run), str(base / f"{run}_hf"), "--quiet"])
        location = find_latest_checkpoint(str(base / run))
        assert location is not None
        run_config = ConfigContainer.from_yaml(Path(location.path) / "run_config.yaml")
        single = single_rank_copy(run_config.model)
        with single_process_megatron(single):
            model = load_model_for_export(Path(location.path), run_config, single, merge=False)
            adapted = sorted(
                name for name, module in model.named_modules() if isinstance(module, LoRAAdapter)
            )
            model.eval()
            out[run] = {
                "export": (code, err.getvalue()),
                "logits": logits_of(model, None),
                "adapted": adapted,
            }
    return out


def _series(path: Path) -> dict[str, dict[int, float]]:
    series: dict[str, dict[int, float]] = {name: {} for name in METRICS}
    for record in read_metrics_file(path):
        for name in METRICS:
            if name in record:
                series[name][int(record["step"])] = float(record[name])
    return series


def _run(
    root: Path, family: str, randomized: Any, family_parity: Any, world: int, extra: list[str]
) -> dict[str, Any]:
    checks = family_parity(root)
    checks.save(_hf_model(family, randomized), "hf")
    (single,) = run_distributed(_import_and_train_one_process, 1, str(root), timeout=900)
    ranks = run_distributed(_train_expert_parallel, world, str(root), extra, timeout=1200)
    runs = ["ep"] if extra else ["ep", "lora"]
    (exported,) = run_distributed(
        _export_and_trainer_logits, 1, str(root), checks.megatron_logits, runs, timeout=600
    )
    return {"root": root, "checks": checks, "single": single, "ranks": ranks, "runs": exported}


@pytest.fixture(scope="module")
def qwen3_moe(
    tmp_path_factory: pytest.TempPathFactory, randomized: Any, family_parity: Any
) -> dict[str, Any]:
    return _run(tmp_path_factory.mktemp("moe"), "qwen3_moe", randomized, family_parity, 2, [])


def _check_equal_to_one_process(result: dict[str, Any]) -> None:
    root = result["root"]
    assert result["single"]["single"] == 0
    assert all(r["ep"] == 0 for r in result["ranks"])
    single, parallel = _series(root / "single.jsonl"), _series(root / "ep.jsonl")
    for name in METRICS:
        assert sorted(single[name]) == list(range(1, ITERS + 1)), (name, single[name])
        for step, want in single[name].items():
            got = parallel[name][step]
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (name, step, got, want)
    losses = [single["lm loss"][step] for step in range(1, ITERS + 1)]
    assert losses[-1] < losses[0]


def _check_resume_is_bit_exact(result: dict[str, Any]) -> None:
    root = result["root"]
    assert all(r["resumed"] == 0 for r in result["ranks"])
    uninterrupted, resumed = _series(root / "ep.jsonl"), _series(root / "resumed.jsonl")
    for name in METRICS:
        assert sorted(resumed[name]) == list(range(6, ITERS + 1)), (name, resumed[name])
        for step, value in resumed[name].items():
            assert value == uninterrupted[name][step], (name, step)


def _check_export_reproduces_trainer(result: dict[str, Any], run: str = "ep") -> None:
    trained = result["runs"][run]
    code, err = trained["export"]
    assert code == 0, err
    checks = result["checks"]
    exported = result["root"] / f"{run}_hf"
    source, tuned = checks.tensors(result["root"] / "hf"), checks.tensors(exported)
    assert sorted(source) == sorted(tuned)
    changed = {name for name in source if not torch.equal(tuned[name], source[name])}
    assert changed  # it trained
    model = transformers.AutoModelForCausalLM.from_pretrained(exported).float().eval()
    error = checks.relative_error(checks.hf_logits(model), trained["logits"])
    assert error <= 1e-5, error
    assert (exported / "tokenizer.json").is_file()
    assert (exported / "generation_config.json").is_file()
    if run == "lora":  # adapters on attention and on every expert, folded in by the export
        assert (
            "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.adapter" in trained["adapted"]
        )
        assert "decoder.layers.0.self_attention.linear_qkv.adapter" in trained["adapted"]
        assert "model.layers.0.mlp.experts.3.gate_proj.weight" in changed
        assert "model.layers.0.mlp.experts.3.down_proj.weight" in changed
        assert "model.layers.0.self_attn.q_proj.weight" in changed
        assert "model.layers.0.mlp.gate.weight" not in changed  # the router is not adapted


def test_expert_parallel_training_equals_one_process(qwen3_moe: dict[str, Any]) -> None:
    _check_equal_to_one_process(qwen3_moe)


def test_expert_parallel_resume_is_bit_exact(qwen3_moe: dict[str, Any]) -> None:
    _check_resume_is_bit_exact(qwen3_moe)


def test_trained_export_loads_in_transformers_with_the_trainers_logits(
    qwen3_moe: dict[str, Any],
) -> None:
    _check_export_reproduces_trainer(qwen3_moe)


def test_lora_on_attention_and_experts_at_ep2_exports_merged(qwen3_moe: dict[str, Any]) -> None:
    assert all(r["lora"] == 0 for r in qwen3_moe["ranks"])
    _check_export_reproduces_trainer(qwen3_moe, "lora")


@pytest.mark.extended
def test_mixtral_expert_parallel_training(
    tmp_path: Path, randomized: Any, family_parity: Any
) -> None:
    result = _run(tmp_path, "mixtral", randomized, family_parity, 2, [])
    _check_equal_to_one_process(result)
    _check_resume_is_bit_exact(result)
    _check_export_reproduces_trainer(result)


@pytest.mark.extended
def test_qwen3_moe_expert_and_tensor_parallel_training(
    tmp_path: Path, randomized: Any, family_parity: Any
) -> None:
    result = _run(
        tmp_path,
        "qwen3_moe",
        randomized,
        family_parity,
        4,
        # The import padded the vocabulary to 384 rows (128 x TP 1); TP=2 keeps them.
        # megatron-core trains MoE layers with tensor parallelism only with sequence
        # parallelism (its MoE layer refuses otherwise).
        [
            "model.tensor_model_parallel_size=2",
            "model.sequence_parallel=true",
            "model.make_vocab_size_divisible_by=64",
        ],
    )
    _check_equal_to_one_process(result)
    _check_resume_is_bit_exact(result)
