"""Hugging Face import/export against real ``transformers`` models (tiny, random, fp32, CPU).

Per family (Llama with GQA and llama3 RoPE scaling, Qwen2 with QKV bias and tied
embeddings, Mistral with a sliding window shorter than the sequence, GPT-2): the imported
checkpoint's logits equal the Hugging Face model's at TP=1 and TP=2 on a batch with a
left-padded row (compared at the real positions); the export of the
import is bit-identical to the source tensors and loads in ``transformers``; a finetune
step runs through ``bridge-train`` from ``checkpoint.pretrained_checkpoint``; bad inputs are
refused with one line and exit code 2. PP=2 x TP=1 logits are checked on the megatron
engine with megatron-core's forward-only pipeline schedule, and a save made at PP=2
exports bit for bit like the import. Two variants of a family's mapping (Llama with biases
on every linear layer, GPT-2 with its own output layer) are checked at TP=1 and TP=2 and
through export; a ``--dtype bfloat16`` export says so in config.json.

One 1-rank and one 2-rank process group are forked for everything.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from bridge.train.checkpointing import layout  # noqa: E402
from bridge.train.convert import cli  # noqa: E402
from bridge.train.testing import write_word_level_tokenizer  # noqa: E402
from core_utils.testing import run_distributed  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

VOCAB = 300  # tokenizer has fewer tokens than the embedding; megatron pads to 512 at TP=2
SEQ = 12
PAD = 4  # the batch's second row is left-padded by PAD tokens


def _mask(tokens: torch.Tensor) -> torch.Tensor:
    """1 for real tokens, 0 for the second row's left padding."""
    mask = torch.ones_like(tokens)
    mask[1, :PAD] = 0
    return mask


def _positions(tokens: torch.Tensor) -> torch.Tensor:
    """Positions counted from each row's first real token (as generation computes them)."""
    return (_mask(tokens).cumsum(-1) - 1).clamp(min=0)


def _attention_mask(tokens: torch.Tensor) -> torch.Tensor:
    """megatron's mask (True: not attended): causal, and no padded key."""
    n = tokens.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool).triu(1)
    return causal[None, None] | (_mask(tokens) == 0)[:, None, None, :]


def _hf_logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens, attention_mask=_mask(tokens), position_ids=_positions(tokens)).logits


def _close(got: torch.Tensor, want: torch.Tensor, tokens: torch.Tensor) -> bool:
    """Equal within 1e-5 at the real (not padded) positions."""
    keep = _mask(tokens).bool()
    return torch.allclose(got[keep], want[keep], atol=1e-5, rtol=0)


FAMILIES = ("llama", "qwen2", "mistral", "gpt2")
# Variants of a family's mapping, checked at TP=1 and TP=2 and through export (not at PP=2):
# Llama with biases on every linear layer (attention_bias and mlp_bias), GPT-2 with an
# output layer of its own (tie_word_embeddings=False).
VARIANTS = ("llama_bias", "gpt2_untied")
CONVERTED = FAMILIES + VARIANTS
PP2_SAVED = ("llama", "qwen2")  # saved at PP=2 after loading, then exported


def _hf_model(family: str) -> Any:
    torch.manual_seed(1234)
    common: dict[str, Any] = {"vocab_size": VOCAB}
    if family in ("llama", "llama_bias"):
        bias = family == "llama_bias"
        config = transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            attention_bias=bias,
            mlp_bias=bias,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            **common,
        )
        model = transformers.LlamaForCausalLM(config)
    elif family == "qwen2":
        config = transformers.Qwen2Config(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=True,
            **common,
        )
        model = transformers.Qwen2ForCausalLM(config)
    elif family == "mistral":
        config = transformers.MistralConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            sliding_window=5,
            tie_word_embeddings=False,
            **common,
        )
        model = transformers.MistralForCausalLM(config)
    else:
        config = transformers.GPT2Config(
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=32,
            tie_word_embeddings=family == "gpt2",
            **common,
        )
        model = transformers.GPT2LMHeadModel(config)
    model = model.float().eval()
    # Random-init biases are zero in transformers; make them count.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    result: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        result.update(load_file(str(file)))
    return result


def _megatron_logits(ckpt: str, tokens: torch.Tensor, tp: int) -> torch.Tensor:
    """Build the model from the checkpoint's run config at ``tp`` and load it as a
    pretrained checkpoint (the finetuning path)."""

    from megatron.core import parallel_state

    from bridge.config import CheckpointConfig, ConfigContainer, DistributedInitConfig
    from bridge.train.checkpointing import restore_checkpoint
    from bridge.train.engine.initialize import initialize_distributed
    from bridge.train.state import TrainState

    cfg = ConfigContainer.from_yaml(Path(ckpt) / "iter_0000000" / "run_config.yaml")
    provider: Any = cfg.model
    imported_tp = provider.tensor_model_parallel_size
    provider.make_vocab_size_divisible_by *= imported_tp // tp
    provider.tensor_model_parallel_size = tp
    provider.finalize()
    initialize_distributed(provider, DistributedInitConfig(distributed_backend="gloo"))
    try:
        model = provider.provide()
        restore_checkpoint(
            CheckpointConfig(pretrained_checkpoint=ckpt), TrainState(), [model], None, None
        )
        model.eval()
        with torch.no_grad():
            logits = model(tokens, _positions(tokens), _attention_mask(tokens))
            if provider.parallel_output and tp > 1:  # vocab-parallel shards: gather them
                group = parallel_state.get_tensor_model_parallel_group()
                parts = [torch.empty_like(logits) for _ in range(tp)]
                torch.distributed.all_gather(parts, logits.contiguous(), group=group)
                logits = torch.cat(parts, dim=-1)
        return logits[..., :VOCAB].clone()
    finally:
        parallel_state.destroy_model_parallel()


def _capture(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, err.getvalue()


def _one_rank(rank: int, world: int, root: str, tokens: torch.Tensor) -> dict[str, Any]:
    """Import every family (layout TP=2), TP=1 logits, export, refusals, a finetune step."""
    from bridge.train.cli import main as bridge_train

    out: dict[str, Any] = {"logits": {}, "refusals": {}}
    base = Path(root)
    for family in CONVERTED:
        code, err = _capture(
            ["import", str(base / family), str(base / f"ckpt_{family}"), "--tp", "2"]
        )
        assert code == 0, err
        out["logits"][family] = _megatron_logits(str(base / f"ckpt_{family}"), tokens, 1)
        code, err = _capture(
            ["export", str(base / f"ckpt_{family}"), str(base / f"export_{family}"), "--quiet"]
        )
        assert code == 0, err
    # A bfloat16 export (its config.json says so, in both spellings of the dtype field).
    out["bf16_export"] = _capture(
        [
            *("export", str(base / "ckpt_llama_bias"), str(base / "export_llama_bias_bf16")),
            *("--dtype", "bfloat16", "--quiet"),
        ]
    )
    # Exports of checkpoints a load would not trust: a flipped byte, an unknown hash.
    for name in ("damaged_ckpt", "unknown_checksum"):
        shutil.copytree(base / "ckpt_llama", base / name)
    iteration = base / "damaged_ckpt" / "iter_0000000"
    shard = sorted(iteration.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    marker = base / "unknown_checksum" / "iter_0000000" / "checkpoint_complete.json"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "checksum": "blake3"}))
    refusals = {
        "damaged_ckpt": ["export", str(base / "damaged_ckpt"), str(base / "e1")],
        "unknown_checksum": ["export", str(base / "unknown_checksum"), str(base / "e2")],
        "model_type": ["import", str(base / "bad_type"), str(base / "c1")],
        "missing_shard": ["import", str(base / "bad_shard"), str(base / "c2")],
        "shape": ["import", str(base / "bad_shape"), str(base / "c3")],
        "tokenizer": ["import", str(base / "bad_tokenizer"), str(base / "c4")],
        "tp": ["import", str(base / "llama"), str(base / "c5"), "--tp", "3"],
        "tp_kv_heads": ["import", str(base / "llama"), str(base / "c6"), "--tp", "4"],
        "existing": ["import", str(base / "llama"), str(base / "ckpt_llama")],
        "no_hf_config": [
            *("export", str(base / "ckpt_llama"), str(base / "e3")),
            *("--hf-config", str(base / "ckpt_llama" / "iter_0000000")),
        ],
        "other_hf_config": [
            *("export", str(base / "ckpt_llama"), str(base / "e4")),
            *("--hf-config", str(base / "qwen2")),
        ],
    }
    for name, argv in refusals.items():
        out["refusals"][name] = _capture([*argv, "--quiet"])
    run_config = base / "ckpt_llama" / "iter_0000000" / "run_config.yaml"
    for run, extra in (
        ("finetuned", []),
        ("lora", ["peft._target_=bridge.train.peft.LoRA", "peft.dim=4", "peft.alpha=8"]),
    ):
        exit_code: Any = None
        try:
            bridge_train(
                [
                    "--config",
                    str(run_config),
                    f"checkpoint.save={base / run}",
                    "checkpoint.save_interval=2",
                    "model.tensor_model_parallel_size=1",
                    "model.make_vocab_size_divisible_by=256",
                    "train.train_iters=2",
                    "train.micro_batch_size=2",
                    "train.global_batch_size=2",
                    "train.eval_iters=0",
                    "scheduler.lr_warmup_iters=0",
                    "model.seq_length=16",
                    "dataset.sequence_length=16",
                    *extra,
                ]
            )
        except SystemExit as exc:  # the command's main exits with the run's code
            exit_code = exc.code
        out[run] = exit_code
        # Exported through the run config's pretrained_checkpoint (hf/ of the import); the
        # LoRA run merged.
        looked: list[str] = []  # every directory the export's tracker lookups read
        find_latest = layout._find_latest

        def spy(
            base: Path, step: int | None, looked: list[str] = looked, find_latest: Any = find_latest
        ) -> Any:
            looked.append(str(base))
            return find_latest(base, step)

        layout._find_latest = spy
        try:
            out[f"{run}_export"] = _capture(
                ["export", str(base / run), str(base / f"export_{run}"), "--quiet"]
            )
        finally:
            layout._find_latest = find_latest
        out[f"{run}_lookups"] = looked
    if out["lora"] == 0:
        out["lora_logits"] = _unmerged_lora_logits(base / "lora", tokens)
    return out


def _unmerged_lora_logits(run_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of base + adapters as trained (not merged)."""
    from bridge.config import ConfigContainer
    from bridge.train.checkpointing import find_latest_checkpoint
    from bridge.train.convert._runtime import single_process_megatron, single_rank_copy
    from bridge.train.convert.exporter import load_model_for_export
    from bridge.train.peft import LoRAAdapter

    location = find_latest_checkpoint(str(run_dir))
    assert location is not None
    iteration_dir = Path(location.path)
    run_config = ConfigContainer.from_yaml(iteration_dir / "run_config.yaml")
    single = single_rank_copy(run_config.model)
    with single_process_megatron(single):
        assert run_config.checkpoint is not None
        model = load_model_for_export(
            iteration_dir,
            single,
            peft=run_config.peft,
            pretrained_checkpoint=run_config.checkpoint.pretrained_checkpoint,
            merge=False,
        )
        assert any(isinstance(m, LoRAAdapter) for m in model.modules())
        assert "_bridge_peft_base_keys" not in vars(model)  # the load's record went with it
        model.eval()
        with torch.no_grad():
            return model(tokens, _positions(tokens), _attention_mask(tokens))[..., :VOCAB].clone()


def _pipeline_logits(
    ckpt: str, tokens: torch.Tensor, save: str | None = None
) -> torch.Tensor | None:
    """Load the checkpoint at PP=2 x TP=1 through the engine's model setup and
    ``restore_checkpoint`` (the finetuning path), and run megatron-core's forward-only pipeline
    schedule on ``tokens`` (one micro-batch per row). The last stage returns the logits, the
    first stage ``None``. With ``save``, the loaded model is first saved there at PP=2."""

    from megatron.core import parallel_state

    from bridge.config import CheckpointConfig, ConfigContainer, DistributedInitConfig
    from bridge.train.checkpointing import restore_checkpoint, write_checkpoint
    from bridge.train.engine import build_engine
    from bridge.train.engine.initialize import destroy_distributed
    from bridge.train.state import TrainState

    cfg = ConfigContainer.from_yaml(Path(ckpt) / "iter_0000000" / "run_config.yaml")
    provider: Any = cfg.model
    provider.make_vocab_size_divisible_by *= provider.tensor_model_parallel_size
    provider.tensor_model_parallel_size = 1
    provider.pipeline_model_parallel_size = 2
    provider.pipeline_dtype = torch.float32
    provider.finalize()
    engine = build_engine()
    engine.initialize_distributed(provider, DistributedInitConfig(distributed_backend="gloo"))
    try:
        chunks = engine.setup_model(provider, wrap_with_ddp=False)
        restore_checkpoint(
            CheckpointConfig(pretrained_checkpoint=ckpt), TrainState(), chunks, None, None
        )
        if save is not None:  # as a finetune at PP=2 would save it (model only)
            cfg.checkpoint = CheckpointConfig(
                save=save, pretrained_checkpoint=ckpt, save_optim=False, save_rng=False
            )
            write_checkpoint(cfg.checkpoint, TrainState(), chunks, None, None, run_config=cfg)
        for chunk in chunks:
            chunk.eval()
        rows = iter(range(tokens.shape[0]))
        positions, attention_mask = _positions(tokens), _attention_mask(tokens)

        def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
            i = next(data_iterator)
            output = model(tokens[i : i + 1], positions[i : i + 1], attention_mask[i : i + 1])

            def collect(output_tensor: torch.Tensor, non_loss_data: bool = False) -> Any:
                assert non_loss_data
                return output_tensor.detach().clone()

            return output, collect

        with torch.no_grad():
            collected = engine.forward_backward_func(
                forward_step_func=forward_step,
                data_iterator=rows,
                model=chunks,
                num_microbatches=tokens.shape[0],
                seq_length=tokens.shape[1],
                micro_batch_size=1,
                decoder_seq_length=tokens.shape[1],
                forward_only=True,
                collect_non_loss_data=True,
            )
        if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            return None
        return torch.cat(list(collected))[..., :VOCAB]
    finally:
        destroy_distributed()


def _two_ranks(rank: int, world: int, root: str, tokens: torch.Tensor) -> dict[str, Any]:
    out: dict[str, Any] = {f: _megatron_logits(f"{root}/ckpt_{f}", tokens, 2) for f in CONVERTED}
    out["pp2"] = {
        f: _pipeline_logits(
            f"{root}/ckpt_{f}", tokens, f"{root}/pp2_{f}" if f in PP2_SAVED else None
        )
        for f in FAMILIES
    }
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("hf")
    tokens = torch.randint(2, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))
    reference: dict[str, torch.Tensor] = {}
    for family in CONVERTED:
        model = _hf_model(family)
        # The llama model is saved in several shards (model.safetensors.index.json).
        shards = {"max_shard_size": "60KB"} if family == "llama" else {}
        model.save_pretrained(root / family, **shards)
        write_word_level_tokenizer(root / family, VOCAB - 20)
        reference[family] = _hf_logits(model, tokens)
    # The dtype as transformers before 4.56 spelled it in config.json.
    config = json.loads((root / "llama_bias" / "config.json").read_text())
    config["torch_dtype"] = config.pop("dtype", "float32")
    (root / "llama_bias" / "config.json").write_text(json.dumps(config, indent=2))
    # Inputs that must be refused.
    shutil.copytree(root / "llama", root / "bad_type")
    config = json.loads((root / "bad_type" / "config.json").read_text())
    (root / "bad_type" / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    shutil.copytree(root / "llama", root / "bad_shard")
    next((root / "bad_shard").glob("model-00002-*.safetensors")).unlink()
    shutil.copytree(root / "qwen2", root / "bad_shape")
    config = json.loads((root / "bad_shape" / "config.json").read_text())
    (root / "bad_shape" / "config.json").write_text(
        json.dumps({**config, "intermediate_size": 128})
    )
    shutil.copytree(root / "qwen2", root / "bad_tokenizer")
    write_word_level_tokenizer(root / "bad_tokenizer", VOCAB + 5)

    (single,) = run_distributed(_one_rank, 1, str(root), tokens, timeout=400)
    double = run_distributed(_two_ranks, 2, str(root), tokens, timeout=300)
    return {"root": root, "tokens": tokens, "reference": reference, "one": single, "two": double}


@pytest.mark.parametrize("family", CONVERTED)
def test_imported_logits_match_hf_at_tp1_and_tp2(converted: dict[str, Any], family: str) -> None:
    expected = converted["reference"][family]
    tp1 = converted["one"]["logits"][family]
    assert tp1.shape == expected.shape
    tokens = converted["tokens"]
    assert _close(tp1, expected, tokens), (tp1 - expected).abs().max()
    for rank_result in converted["two"]:
        tp2 = rank_result[family]
        assert _close(tp2, expected, tokens), (tp2 - expected).abs().max()


@pytest.mark.parametrize("family", FAMILIES)
def test_imported_logits_match_hf_at_pp2(converted: dict[str, Any], family: str) -> None:
    """PP=2 on megatron-core's engine: only the last stage (rank 1) holds logits."""
    expected = converted["reference"][family]
    first, last = (rank_result["pp2"][family] for rank_result in converted["two"])
    assert first is None
    assert last.shape == expected.shape
    assert _close(last, expected, converted["tokens"]), (last - expected).abs().max()


@pytest.mark.parametrize("family", CONVERTED)
def test_export_of_import_is_bit_identical_and_loads(
    converted: dict[str, Any], family: str
) -> None:
    root: Path = converted["root"]
    source, exported = _tensors(root / family), _tensors(root / f"export_{family}")
    assert sorted(source) == sorted(exported)
    for name, tensor in source.items():
        assert exported[name].dtype == tensor.dtype, name
        assert torch.equal(exported[name], tensor), name
    model = transformers.AutoModelForCausalLM.from_pretrained(root / f"export_{family}").eval()
    logits = _hf_logits(model, converted["tokens"])
    assert torch.equal(logits, converted["reference"][family])
    assert (root / f"export_{family}" / "tokenizer.json").is_file()
    if family in VARIANTS:  # what makes the variant survives the round trip
        config = json.loads((root / f"export_{family}" / "config.json").read_text())
        if family == "llama_bias":
            assert config["attention_bias"] and config["mlp_bias"]
            for name in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "self_attn.o_proj"):
                bias = exported[f"model.layers.1.{name}.bias"]
                assert bias.abs().sum() > 0 and torch.equal(
                    bias, source[f"model.layers.1.{name}.bias"]
                )
        else:
            assert config["tie_word_embeddings"] is False
            assert not torch.equal(exported["lm_head.weight"], exported["transformer.wte.weight"])


def test_a_bfloat16_export_says_so_in_config_json(converted: dict[str, Any]) -> None:
    """``--dtype bfloat16`` of a float32 import: bfloat16 tensors (the source's, rounded) and
    a config.json whose ``dtype`` (and ``torch_dtype``, the spelling the source used) say
    ``bfloat16``; the default export copies the source's config.json as it is."""
    root: Path = converted["root"]
    code, err = converted["one"]["bf16_export"]
    assert code == 0, err
    out = root / "export_llama_bias_bf16"
    config = json.loads((out / "config.json").read_text())
    assert (config["dtype"], config["torch_dtype"]) == ("bfloat16", "bfloat16")
    source, written = _tensors(root / "llama_bias"), _tensors(out)
    assert sorted(written) == sorted(source)
    for name, tensor in source.items():
        assert written[name].dtype == torch.bfloat16, name
        assert torch.equal(written[name], tensor.to(torch.bfloat16)), name
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    same = (root / "export_llama_bias" / "config.json").read_bytes()
    assert same == (root / "llama_bias" / "config.json").read_bytes()


def test_finetune_step_through_bridge_train_and_export(converted: dict[str, Any]) -> None:
    root: Path = converted["root"]
    assert converted["one"]["finetuned"] == 0
    assert (root / "finetuned" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    code, err = converted["one"]["finetuned_export"]
    assert code == 0, err
    tuned, source = _tensors(root / "export_finetuned"), _tensors(root / "llama")
    assert sorted(tuned) == sorted(source)
    assert any(not torch.equal(tuned[n], source[n]) for n in source)  # it trained
    transformers.AutoModelForCausalLM.from_pretrained(root / "export_finetuned")


def test_lora_finetune_exports_merged(converted: dict[str, Any]) -> None:
    root: Path = converted["root"]
    assert converted["one"]["lora"] == 0
    code, err = converted["one"]["lora_export"]
    assert code == 0, err
    lookups = converted["one"]["lora_lookups"]
    assert len(lookups) == len(set(lookups)), lookups  # each directory is looked up once
    merged, source = _tensors(root / "export_lora"), _tensors(root / "llama")
    assert sorted(merged) == sorted(source)  # plain Hugging Face names, no adapter tensors
    changed = {n for n in source if not torch.equal(merged[n], source[n])}
    assert "model.layers.0.self_attn.q_proj.weight" in changed  # adapters were folded in
    assert "model.embed_tokens.weight" not in changed  # LoRA leaves the embedding alone
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "export_lora").eval()
    logits = _hf_logits(model, converted["tokens"])
    expected = converted["one"]["lora_logits"]
    assert _close(logits, expected, converted["tokens"]), (logits - expected).abs().max()


def _export_pp2_saves(rank: int, world: int, root: str) -> dict[str, tuple[int, str]]:
    base = Path(root)
    return {
        f: _capture(["export", str(base / f"pp2_{f}"), str(base / f"export_pp2_{f}"), "--quiet"])
        for f in PP2_SAVED
    }


def test_export_of_a_pp2_save_equals_the_single_process_export(
    converted: dict[str, Any],
) -> None:
    """The import loaded at PP=2 x TP=1 and saved by the two stages exports bit for bit
    like the import itself (exported in one process)."""
    root: Path = converted["root"]
    (codes,) = run_distributed(_export_pp2_saves, 1, str(root), timeout=300)
    for family in PP2_SAVED:
        saved = yaml.safe_load(
            (root / f"pp2_{family}" / "iter_0000000" / "run_config.yaml").read_text()
        )
        assert saved["model"]["pipeline_model_parallel_size"] == 2
        code, err = codes[family]
        assert code == 0, err
        expected, exported = (
            _tensors(root / f"export_{family}"),
            _tensors(root / f"export_pp2_{family}"),
        )
        assert sorted(exported) == sorted(expected)
        for name, tensor in expected.items():
            assert exported[name].dtype == tensor.dtype, name
            assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("model_type", "model_type='bert' is not supported"),
        ("missing_shard", "is missing"),
        ("shape", "shape mismatch"),
        ("tokenizer", "tokens but the model's embedding"),
        ("tp", "tensor_model_parallel_size=3"),
        (
            "tp_kv_heads",
            "--tp 4 does not divide the model's 2 key/value heads (num_key_value_heads); "
            "megatron-core needs whole query groups on every tensor-parallel rank",
        ),
        ("existing", "already exists and is not empty"),
        ("damaged_ckpt", "does not match its saved checksum"),
        ("unknown_checksum", "names checksum algorithm 'blake3', which this version cannot"),
        ("no_hf_config", "iter_0000000 has no config.json"),
        ("other_hf_config", "config.json describes another model: "),
    ],
)
def test_bad_inputs_are_refused_with_one_line(
    converted: dict[str, Any], case: str, needle: str
) -> None:
    code, err = converted["one"]["refusals"][case]
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bridge-convert: error: "), err
    assert needle in lines[0], lines[0]
    if case == "damaged_ckpt":
        assert "is damaged: " in lines[0] and "restore it from a copy" in lines[0], lines[0]


def test_plain_bridge_train_does_not_import_conversion_and_exit_code() -> None:
    script = (
        "import sys, bridge.train\n"
        "loaded = [m for m in sys.modules if m.startswith('bridge.train.convert') "
        "or m in ('safetensors', 'transformers')]\n"
        "assert not loaded, loaded\n"
        # Run as `python -m bridge.train.convert import ...` (the module entry point).
        "import runpy\n"
        "sys.argv = ['bridge-convert', 'import', '/nonexistent-hf-dir', '/tmp/unused-ckpt']\n"
        "runpy.run_module('bridge.train.convert', run_name='__main__', alter_sys=True)\n"
    )
    # Let the child cache bytecode (as nox does): recompiling torch costs most of its start.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240, env=env
    )
    assert result.returncode == 2, result.stderr
    assert "bridge-convert: error: /nonexistent-hf-dir is not a directory" in result.stderr
