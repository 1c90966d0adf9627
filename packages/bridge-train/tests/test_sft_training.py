"""SFT trains through ``pretrain``: prompt tokens get no loss and no gradient (checked on the
logits' gradient), packed and unpacked samples give the same per-token losses, examples in
one packed sequence do not see each other, and a stopped and resumed SFT run gives the
losses of an uninterrupted one bit for bit.

One forked 1-rank process runs all checks (pretrain re-creates its process group per run).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from bridge.config import (
    CheckpointConfig,
    FinetuningDatasetConfig,
    LoggerConfig,
    TokenizerConfig,
)
from bridge.train import pretrain
from bridge.train.data.packing import PackedSFTDataset
from bridge.train.data.sft import SFTDataset, load_tokenized_examples, sft_settings
from bridge.train.data.tokenizers import ByteLevelTokenizer
from bridge.train.metrics import read_metrics_file
from bridge.train.peft import LoRA
from bridge.train.testing import (
    tiny_config_container,
    tiny_gpt_provider,
    tiny_train_config,
    write_tiny_sft_task,
)
from core_utils.testing import run_distributed

SEQ = 32
TOKENIZER = ByteLevelTokenizer()


@dataclass
class TrainFinalNorm:
    """A PEFT transform of one's own: train only the final layer norm."""

    def __call__(self, model: Any, training: bool = True) -> Any:
        for name, param in model.named_parameters():
            param.requires_grad_(name.startswith("decoder.final_layernorm"))
        return model


def _sft_config(
    root: Path,
    save: str | None,
    *,
    pretrained: str | None = None,
    peft: Any = None,
    hidden: int = 32,
    **train: Any,
) -> Any:
    return tiny_config_container(
        train=tiny_train_config(**{"train_iters": 6, "global_batch_size": 4, **train}),
        model=tiny_gpt_provider(vocab_size=258, seq_length=SEQ, hidden_size=hidden),
        peft=peft,
        tokenizer=TokenizerConfig(tokenizer_type="ByteLevelTokenizer"),
        dataset=FinetuningDatasetConfig(
            dataset_root=root,
            seq_length=SEQ,
            num_workers=0,
            pin_memory=False,
            dataloader_type="single",
            do_validation=False,
            do_test=False,
        ),
        logger=LoggerConfig(log_interval=1),
        checkpoint=CheckpointConfig(save=save, save_interval=3, pretrained_checkpoint=pretrained),
    )


def _losses(path: Path) -> dict[int, float]:
    return {int(r["step"]): r["lm loss"] for r in read_metrics_file(path) if "lm loss" in r}


def _logits_and_grads(model: Any, batch: dict[str, torch.Tensor]) -> tuple[Any, Any, Any]:
    """Per-token losses, logits and d(masked mean loss)/d(logits) of one batch."""
    captured: dict[str, torch.Tensor] = {}

    def keep(_module: Any, _inputs: Any, output: Any) -> None:
        logits = output[0]
        logits.retain_grad()
        captured["logits"] = logits

    handle = model.output_layer.register_forward_hook(keep)
    model.zero_grad()
    losses = model(
        batch["tokens"],
        batch["position_ids"],
        batch.get("attention_mask"),
        labels=batch["labels"],
    )
    handle.remove()
    mask = batch["loss_mask"]
    ((losses * mask).sum() / mask.sum()).backward()
    logits = captured["logits"]  # [s, b, v]
    assert logits.grad is not None
    return losses.detach(), logits.detach().transpose(0, 1), logits.grad.transpose(0, 1)


def _checks(rank: int, world: int, root: str) -> dict[str, Any]:
    from bridge.train.engine import MegatronEngine
    from bridge.train.testing import tiny_dist_config, tiny_rng_config

    out: dict[str, Any] = {}
    provider = tiny_gpt_provider(vocab_size=258, seq_length=SEQ)
    engine = MegatronEngine()
    engine.initialize_distributed(provider, tiny_dist_config(), tiny_rng_config())
    model = engine.setup_model(provider, wrap_with_ddp=False)[0]
    examples = load_tokenized_examples(Path(root) / "training.jsonl", TOKENIZER, sft_settings(None))
    unpacked = SFTDataset(examples, SEQ, TOKENIZER.pad)
    batch = torch.utils.data.default_collate([unpacked[0], unpacked[1]])
    _, _, grads = _logits_and_grads(model, batch)
    mask = batch["loss_mask"].bool()
    out["prompt_grad_max"] = float(grads[~mask].abs().max())
    out["answer_grad_min"] = float(grads[mask].abs().amax(-1).min())
    out["answer_tokens"] = int(mask.sum())

    # Packed vs unpacked: same per-token losses on every example's positions.
    packed = PackedSFTDataset(examples, SEQ, TOKENIZER.pad, shuffle_seed=None)
    sample = packed[0]
    packed_batch = torch.utils.data.default_collate([sample])
    packed_losses, packed_logits, _ = _logits_and_grads(model, packed_batch)
    worst = 0.0
    start = 0
    for index in packed.bins[0]:
        alone = torch.utils.data.default_collate([unpacked[index]])
        alone_losses, _, _ = _logits_and_grads(model, alone)
        n = len(packed.examples[index][0]) - 1
        diff = (packed_losses[0, start : start + n] - alone_losses[0, :n]).abs().max()
        worst = max(worst, float(diff))
        start += n
    out["packed_vs_unpacked"] = worst
    out["examples_in_first_pack"] = len(packed.bins[0])
    # Perturb the first example's tokens: the other examples' logits stay the same.
    first = len(packed.examples[packed.bins[0][0]][0]) - 1
    perturbed = dict(packed_batch)
    perturbed["tokens"] = packed_batch["tokens"].clone()
    perturbed["tokens"][0, :first] = (perturbed["tokens"][0, :first] + 7) % 256
    _, perturbed_logits, _ = _logits_and_grads(model, perturbed)
    out["others_changed"] = float(
        (perturbed_logits[0, first:start] - packed_logits[0, first:start]).abs().max()
    )
    out["first_changed"] = float(
        (perturbed_logits[0, :first] - packed_logits[0, :first]).abs().max()
    )
    from bridge.train.engine.initialize import destroy_distributed

    destroy_distributed()

    # pretrain on SFT data: uninterrupted vs stopped at 3 and resumed.
    base = Path(root).parent
    metrics = {name: str(base / f"{name}.jsonl") for name in ("ref", "stop", "resume")}
    out["codes"] = [
        pretrain(_sft_config(Path(root), str(base / "ref_ckpt")), metrics_file=metrics["ref"]),
        pretrain(
            _sft_config(Path(root), str(base / "run_ckpt"), exit_interval=3),
            metrics_file=metrics["stop"],
        ),
        pretrain(_sft_config(Path(root), str(base / "run_ckpt")), metrics_file=metrics["resume"]),
    ]
    # Finetuning from the SFT run's checkpoint: full (weights only, from iteration 0), LoRA
    # (uninterrupted, and stopped at 3 then resumed from its adapter-only checkpoint), and a
    # PEFT object of one's own.
    base_ckpt = str(base / "ref_ckpt")
    lora = LoRA(dim=4, alpha=8.0)
    for name in ("full_ft", "lora_ref", "lora_stop", "lora_resume", "own"):
        metrics[name] = str(base / f"{name}.jsonl")
    out["codes"] += [
        pretrain(
            _sft_config(Path(root), str(base / "full_ft_ckpt"), pretrained=base_ckpt),
            metrics_file=metrics["full_ft"],
        ),
        pretrain(
            _sft_config(Path(root), str(base / "lora_ref"), pretrained=base_ckpt, peft=lora),
            metrics_file=metrics["lora_ref"],
        ),
        pretrain(
            _sft_config(
                Path(root), str(base / "lora_run"), pretrained=base_ckpt, peft=lora, exit_interval=3
            ),
            metrics_file=metrics["lora_stop"],
        ),
        pretrain(
            _sft_config(Path(root), str(base / "lora_run"), pretrained=base_ckpt, peft=lora),
            metrics_file=metrics["lora_resume"],
        ),
        pretrain(
            _sft_config(Path(root), str(base / "own"), pretrained=base_ckpt, peft=TrainFinalNorm()),
            metrics_file=metrics["own"],
        ),
    ]
    out["losses"] = {name: _losses(Path(path)) for name, path in metrics.items()}
    from megatron.core.dist_checkpointing import load_tensors_metadata

    out["lora_keys"] = sorted(load_tensors_metadata(str(base / "lora_run" / "iter_0000006")))
    out["own_keys"] = sorted(load_tensors_metadata(str(base / "own" / "iter_0000006")))
    try:
        pretrain(_sft_config(Path(root), None, pretrained=base_ckpt, hidden=64))
        out["other_architecture"] = "loaded"
    except Exception as exc:
        out["other_architecture"] = str(exc)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_sft_masking_packing_and_resume(tmp_path: Path) -> None:
    root = tmp_path / "data"
    write_tiny_sft_task(root)
    (result,) = run_distributed(_checks, 1, str(root), timeout=240)
    assert result["prompt_grad_max"] == 0.0  # no gradient reaches a prompt position
    assert result["answer_grad_min"] > 0.0  # every answer position gets one
    assert result["answer_tokens"] in (4, 5, 6)  # two answers of 1-2 digits + <eod>
    assert result["examples_in_first_pack"] >= 4
    assert result["packed_vs_unpacked"] < 1e-5
    assert result["others_changed"] == 0.0 and result["first_changed"] > 0.0
    assert result["codes"][:3] == [0, 0, 0]
    losses = result["losses"]
    assert sorted(losses["ref"]) == [1, 2, 3, 4, 5, 6]
    assert sorted(losses["stop"]) == [1, 2, 3] and sorted(losses["resume"]) == [4, 5, 6]
    for name in ("stop", "resume"):
        for step, loss in losses[name].items():
            assert loss == losses["ref"][step], (name, step)

    # Finetune loads: weights only, from iteration 0; LoRA starts from the same base exactly
    # (B = 0), then trains differently; its resume is exact.
    assert result["codes"][3:] == [0, 0, 0, 0, 0]
    assert sorted(losses["full_ft"]) == [1, 2, 3, 4, 5, 6]
    assert losses["full_ft"][1] < losses["ref"][1]  # the trained base was loaded
    assert losses["lora_ref"][1] == losses["full_ft"][1]
    assert losses["lora_ref"][6] != losses["full_ft"][6]
    assert sorted(losses["lora_stop"]) == [1, 2, 3] and sorted(losses["lora_resume"]) == [4, 5, 6]
    for name in ("lora_stop", "lora_resume"):
        for step, loss in losses[name].items():
            assert loss == losses["lora_ref"][step], (name, step)
    model_keys = [k for k in result["lora_keys"] if not k.startswith("optimizer")]
    assert model_keys and all(".adapter." in k for k in model_keys)  # adapter-only
    own_model_keys = [k for k in result["own_keys"] if not k.startswith("optimizer")]
    assert own_model_keys and all("final_layernorm" in k for k in own_model_keys)
    assert losses["own"][1] == losses["full_ft"][1] and losses["own"][6] != losses["own"][1]
    assert "different shape" in result["other_architecture"]
