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

Extended tier: the same checks for DeepSeek-V3 (multi-latent attention, sigmoid routing
with the expert-bias correction, which training updates and checkpoints, shared experts, a
dense first layer, sequence-wise balance loss; LoRA on the latent projections and the
experts) and gpt-oss (attention sinks, YaRN, biased experts with the clamped SwiGLU stored
stacked; LoRA on attention and the experts), Mixtral, and Qwen3-MoE at EP=2 x TP=2 (with
sequence parallelism, which megatron-core requires for MoE with tensor parallelism) on
four ranks.
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
LORA = ("peft._target_=bridge.train.peft.LoRA", "peft.dim=4", "peft.alpha=8")
# The metrics logged every step, per family (DeepSeek-V3 balances per sequence).
METRICS = {
    "qwen3_moe": ("lm loss", "load_balancing_loss", "z_loss"),
    "mixtral": ("lm loss", "load_balancing_loss", "z_loss"),
    "gpt_oss": ("lm loss", "load_balancing_loss", "z_loss"),
    "deepseek_v3": ("lm loss", "seq_load_balancing_loss", "z_loss"),
}
# LoRA targets beyond the defaults (multi-latent attention has no linear_qkv).
LORA_TARGETS = {
    "deepseek_v3": (
        "peft.target_modules=[linear_q_down_proj,linear_q_up_proj,linear_kv_down_proj,"
        "linear_kv_up_proj,linear_proj,linear_fc1,linear_fc2]",
    ),
}
# Per family: an adapted attention layer and expert, and Hugging Face tensors a LoRA
# export must change (adapted) and keep (the router).
LORA_EXPECTED: dict[str, dict[str, tuple[str, ...]]] = {
    "qwen3_moe": {
        "adapted": (
            "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.adapter",
            "decoder.layers.0.self_attention.linear_qkv.adapter",
        ),
        "changed": (
            "model.layers.0.mlp.experts.3.gate_proj.weight",
            "model.layers.0.mlp.experts.3.down_proj.weight",
            "model.layers.0.self_attn.q_proj.weight",
        ),
        "kept": ("model.layers.0.mlp.gate.weight",),
    },
    "deepseek_v3": {
        "adapted": (
            "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.adapter",
            "decoder.layers.1.mlp.shared_experts.linear_fc1.adapter",
            "decoder.layers.1.self_attention.linear_q_down_proj.adapter",
            "decoder.layers.1.self_attention.linear_kv_up_proj.adapter",
        ),
        "changed": (
            "model.layers.1.mlp.experts.3.gate_proj.weight",
            "model.layers.1.mlp.shared_experts.down_proj.weight",
            "model.layers.1.self_attn.q_a_proj.weight",
            "model.layers.1.self_attn.kv_b_proj.weight",
            "model.layers.1.self_attn.o_proj.weight",
        ),
        "kept": (
            "model.layers.1.mlp.gate.weight",
            "model.layers.1.mlp.gate.e_score_correction_bias",
            "model.layers.1.self_attn.kv_a_layernorm.weight",
        ),
    },
    "gpt_oss": {
        "adapted": (
            "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.adapter",
            "decoder.layers.0.self_attention.linear_qkv.adapter",
        ),
        "changed": (
            "model.layers.0.mlp.experts.gate_up_proj",
            "model.layers.0.mlp.experts.down_proj",
            "model.layers.0.self_attn.q_proj.weight",
        ),
        "kept": (
            "model.layers.0.mlp.router.weight",
            "model.layers.0.mlp.router.bias",
            "model.layers.0.self_attn.sinks",
            "model.layers.0.mlp.experts.gate_up_proj_bias",
        ),
    },
}


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
    if family == "gpt_oss":
        config = transformers.GptOssConfig(
            intermediate_size=32,
            head_dim=16,
            num_local_experts=4,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            router_aux_loss_coef=0.01,
            **{**common, "max_position_embeddings": 4096 * 4},
        )
        model = randomized(transformers.GptOssForCausalLM(config))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("sinks"):
                    param.normal_(0.0, 1.0)
                elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                    param.normal_(0.0, 0.6)  # the clamp cuts some gate and up values
        return model
    if family == "deepseek_v3":
        config = transformers.DeepseekV3Config(
            intermediate_size=96,
            moe_intermediate_size=32,
            n_shared_experts=1,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "mscale": 0.9,
                "mscale_all_dim": 0.7,
            },
            **{**common, "num_experts_per_tok": 4, "num_key_value_heads": 4},
        )
        model = randomized(transformers.DeepseekV3ForCausalLM(config))
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.normal_(0.0, 0.2)
        return model
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


def _train_expert_parallel(
    rank: int, world: int, root: str, extra: list[str], lora: list[str] | None
) -> dict[str, Any]:
    base = Path(root)
    layout = ["model.expert_model_parallel_size=2", *extra]
    out = {"ep": _train(_overrides(base, "ep", *layout))}
    out["resumed"] = _train(
        _overrides(
            base, "resumed", *layout, f"checkpoint.load={base / 'ep'}", "checkpoint.ckpt_step=5"
        )
    )
    if lora is not None:  # LoRA on attention and on every expert, from the imported weights
        out["lora"] = _train(_overrides(base, "lora", *layout, *LORA, *lora, iters=2))
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
            assert run_config.checkpoint is not None
            model = load_model_for_export(
                Path(location.path),
                single,
                peft=run_config.peft,
                pretrained_checkpoint=run_config.checkpoint.pretrained_checkpoint,
                merge=False,
            )
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


def _series(path: Path, metrics: tuple[str, ...]) -> dict[str, dict[int, float]]:
    series: dict[str, dict[int, float]] = {name: {} for name in metrics}
    for record in read_metrics_file(path):
        for name in metrics:
            if name in record:
                series[name][int(record["step"])] = float(record[name])
    return series


def _run(
    root: Path, family: str, randomized: Any, family_parity: Any, world: int, extra: list[str]
) -> dict[str, Any]:
    checks = family_parity(root)
    checks.save(_hf_model(family, randomized), "hf")
    (single,) = run_distributed(_import_and_train_one_process, 1, str(root), timeout=900)
    lora = None if extra or family not in LORA_EXPECTED else list(LORA_TARGETS.get(family, ()))
    ranks = run_distributed(_train_expert_parallel, world, str(root), extra, lora, timeout=1200)
    runs = ["ep"] if lora is None else ["ep", "lora"]
    (exported,) = run_distributed(
        _export_and_trainer_logits, 1, str(root), checks.megatron_logits, runs, timeout=600
    )
    return {
        "root": root,
        "family": family,
        "metrics": METRICS[family],
        "checks": checks,
        "single": single,
        "ranks": ranks,
        "runs": exported,
    }


@pytest.fixture(scope="module")
def qwen3_moe(
    tmp_path_factory: pytest.TempPathFactory, randomized: Any, family_parity: Any
) -> dict[str, Any]:
    return _run(tmp_path_factory.mktemp("moe"), "qwen3_moe", randomized, family_parity, 2, [])


def _check_equal_to_one_process(result: dict[str, Any]) -> None:
    root, metrics = result["root"], result["metrics"]
    assert result["single"]["single"] == 0
    assert all(r["ep"] == 0 for r in result["ranks"])
    single, parallel = _series(root / "single.jsonl", metrics), _series(root / "ep.jsonl", metrics)
    for name in metrics:
        assert sorted(single[name]) == list(range(1, ITERS + 1)), (name, single[name])
        for step, want in single[name].items():
            got = parallel[name][step]
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (name, step, got, want)
    losses = [single["lm loss"][step] for step in range(1, ITERS + 1)]
    assert losses[-1] < losses[0]


def _check_resume_is_bit_exact(result: dict[str, Any]) -> None:
    root, metrics = result["root"], result["metrics"]
    assert all(r["resumed"] == 0 for r in result["ranks"])
    uninterrupted = _series(root / "ep.jsonl", metrics)
    resumed = _series(root / "resumed.jsonl", metrics)
    for name in metrics:
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
        expected = LORA_EXPECTED[result["family"]]
        for name in expected["adapted"]:
            assert name in trained["adapted"], name
        for name in expected["changed"]:
            assert name in changed, name
        for name in expected["kept"]:  # the router (and its bias correction) is not adapted
            assert name not in changed, name


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
@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_deepseek_v3_and_gpt_oss_train_at_ep2(
    family: str, tmp_path: Path, randomized: Any, family_parity: Any
) -> None:
    """10 steps at EP=2 equal one process, resume is bit-exact, the trained export
    reproduces the trainer's logits in transformers, and LoRA adapts attention and experts."""
    result = _run(tmp_path, family, randomized, family_parity, 2, [])
    _check_equal_to_one_process(result)
    _check_resume_is_bit_exact(result)
    _check_export_reproduces_trainer(result)
    if family == "deepseek_v3":  # the expert-bias correction trained (aux-loss-free balance)
        checks = result["checks"]
        source, tuned = checks.tensors(tmp_path / "hf"), checks.tensors(tmp_path / "ep_hf")
        name = "model.layers.1.mlp.gate.e_score_correction_bias"
        assert not torch.equal(tuned[name], source[name])
    assert all(r["lora"] == 0 for r in result["ranks"])
    _check_export_reproduces_trainer(result, "lora")


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
