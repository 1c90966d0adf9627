"""Export of models no Hugging Face directory came with: the family is chosen from the
provider, or the export is refused naming the fields.

* Every family's preset reads back through the ``config.json`` that family writes for it
  (``match_family``), so a provider made from a family's config leaves as that family (a
  Mistral without a sliding window computes what a Llama computes and leaves as one).
* A provider no family reproduces is refused with one line naming the field(s).
* ``tiny_gpt`` (the default recipe, trained from scratch for two steps in a forked process)
  exports with ``bridge-convert`` as a GPT-2 (the progress line says so), with a
  ``generation_config.json``, and transformers computes the trained model's logits.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from bridge.train.convert import ConversionError, provider_from_hf_config
from bridge.train.models.families import match_family

LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 64,
}
MOE = {"num_experts_per_tok": 2, "intermediate_size": 32}
CASES: list[tuple[str, dict[str, Any]]] = [
    ("llama", {}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("mistral", {"model_type": "mistral", "sliding_window": 8}),
    ("llama", {"model_type": "mistral", "sliding_window": None}),
    ("qwen2", {"model_type": "qwen2", "tie_word_embeddings": True}),
    ("qwen3", {"model_type": "qwen3", "head_dim": 24}),
    (
        "qwen3_moe",
        {"model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 16, **MOE},
    ),
    ("mixtral", {"model_type": "mixtral", "num_local_experts": 4, **MOE}),
    (
        "deepseek_v3",
        {
            "model_type": "deepseek_v3",
            "num_key_value_heads": 4,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "moe_intermediate_size": 16,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 16,
            "q_lora_rank": 24,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            **MOE,
        },
    ),
    (
        "gpt_oss",
        {
            "model_type": "gpt_oss",
            "num_local_experts": 4,
            "head_dim": 16,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention"],
            "attention_bias": True,
            **MOE,
        },
    ),
    (
        "gpt_oss",
        {
            "model_type": "gpt_oss",
            "num_local_experts": 4,
            "head_dim": 16,
            "layer_types": ["full_attention", "full_attention"],
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            "attention_bias": True,
            **MOE,
        },
    ),
    (
        "gemma3_text",
        {
            "model_type": "gemma3_text",
            "head_dim": 16,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24,
        },
    ),
    (
        "gemma3_text",
        {
            "model_type": "gemma3_text",
            "head_dim": 16,
            "layer_types": ["full_attention", "full_attention"],
            "query_pre_attn_scalar": 24,
        },
    ),
]


@pytest.mark.parametrize(("expected", "changes"), CASES)
def test_a_family_preset_leaves_as_that_family(expected: str, changes: dict[str, Any]) -> None:
    provider = provider_from_hf_config({**LLAMA, **changes})
    family, config = match_family(provider)
    assert family.name == expected
    assert config["model_type"] == expected


def test_autobridge_lookups_and_a_provider_bridge_without_weights(tmp_path: Path) -> None:
    """``list_supported_models`` is every registered ``model_type``; ``can_handle`` answers
    from ``config.json`` alone; a bridge made from a provider has no weights to load."""
    from bridge.train.convert import AutoBridge, supported_model_types

    assert AutoBridge.list_supported_models() == list(supported_model_types())
    assert {"gpt2", "llama", "gemma3", "gpt_oss", "deepseek_v3"} <= set(supported_model_types())
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert AutoBridge.can_handle(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "model_type": "bert"}))
    assert not AutoBridge.can_handle(tmp_path)
    bridge = AutoBridge.from_provider(provider_from_hf_config(LLAMA))
    with pytest.raises(ConversionError, match="no Hugging Face weights"):
        bridge.load_hf_weights([])


def test_gpt2_preset_leaves_as_gpt2() -> None:
    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 32}
    family, config = match_family(provider_from_hf_config({**gpt2, "vocab_size": 300}))
    assert family.name == "gpt2" and config["n_positions"] == 32


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        # Every field is some family's, but not together: the closest family's differences.
        (
            {"gated_linear_unit": False, "activation_func": "gelu"},
            "no Hugging Face family matches this model; the closest, llama, differs in "
            "activation_func=gelu (llama: silu), gated_linear_unit=False (llama: True)",
        ),
        # A field no family has.
        ({"rotary_percent": 0.5}, "no Hugging Face family has this model's rotary_percent=0.5"),
    ],
)
def test_a_provider_no_family_has_is_refused_naming_fields(
    changes: dict[str, Any], needle: str
) -> None:
    import torch

    provider = provider_from_hf_config(LLAMA)
    for name, value in changes.items():
        setattr(provider, name, torch.nn.functional.gelu if value == "gelu" else value)
    with pytest.raises(ConversionError) as info:
        match_family(provider)
    message = str(info.value)
    assert needle in message and "\n" not in message, message


def _train_and_export(rank: int, world: int, root: str, logits_of: Any) -> dict[str, Any]:
    from bridge.config import ConfigContainer
    from bridge.train.checkpointing import find_latest_checkpoint
    from bridge.train.cli import main as bridge_train
    from bridge.train.convert import cli
    from bridge.train.convert._runtime import single_process_megatron, single_rank_copy
    from bridge.train.convert.exporter import load_model_for_export

    base = Path(root)
    code: Any = None
    try:
        bridge_train(
            [
                "--no-print-config",
                f"checkpoint.save={base / 'run'}",
                "train.train_iters=2",
                "train.eval_iters=0",
                "train.global_batch_size=2",
                "train.micro_batch_size=2",
                "model.num_layers=2",
                "model.hidden_size=64",
                "model.seq_length=16",
                "tokenizer.vocab_size=300",  # the padded test batch uses ids below 300
            ]
        )
    except SystemExit as exc:
        code = exc.code
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        exported = cli.main(["export", str(base / "run"), str(base / "hf")])
    location = find_latest_checkpoint(str(base / "run"))
    assert location is not None
    run_config = ConfigContainer.from_yaml(Path(location.path) / "run_config.yaml")
    single = single_rank_copy(run_config.model)
    with single_process_megatron(single):
        assert run_config.peft is None  # trained from scratch: no adapters, no base
        model = load_model_for_export(Path(location.path), single)
        model.eval()
        logits = logits_of(model, None)
    return {"train": code, "export": (exported, err.getvalue()), "logits": logits}


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_a_model_trained_from_scratch_exports_as_gpt2(tmp_path: Path, family_parity: Any) -> None:
    transformers = pytest.importorskip("transformers")
    from core_utils.testing import run_distributed

    checks = family_parity(tmp_path)
    (result,) = run_distributed(
        _train_and_export, 1, str(tmp_path), checks.megatron_logits, timeout=800
    )
    assert result["train"] in (0, None)
    code, err = result["export"]
    assert code == 0, err
    assert "writing a gpt2 (GPT2LMHeadModel) config.json" in err
    assert (tmp_path / "hf" / "generation_config.json").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    assert type(model).__name__ == "GPT2LMHeadModel"
    logits = checks.hf_logits(model)[..., :300]
    error = checks.relative_error(logits, result["logits"])
    assert error <= 1e-5, error
