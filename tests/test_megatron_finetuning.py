"""Finetuning on megatron-core's engine on CPU: SFT, packed SFT and LoRA.

Every run is ``pretrain`` on the shipped-style addition task (``write_tiny_sft_task``), on
megatron-core's DDP, optimizers and schedules under core-utils' CUDA emulation. Checked:

* SFT and packed SFT train; a stopped and resumed SFT run gives the uninterrupted run's
  losses bit for bit.
* LoRA: the frozen base is absent from megatron's DDP grad buffers and from the optimizer
  (plain and distributed); a LoRA run from the SFT checkpoint trains; its adapter-only
  checkpoint resumes bit for bit; TP=2 and DP=2 with the distributed optimizer give the
  losses and the saved (global) adapters of one process within 1e-5.

One forked 1-rank group runs every single-process job in turn and one 2-rank group every
two-rank job, so the process start-up cost is paid twice. The extended test adds packed
SFT resume, resumes under TP=2 and DP=2 with the distributed optimizer, and LoRA on packed
sequences.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from bridge.config import (
    CheckpointConfig,
    DistributedDataParallelConfig,
    FinetuningDatasetConfig,
    LoggerConfig,
    PackedSequenceSpecs,
    TokenizerConfig,
)
from bridge.train import pretrain
from bridge.train.metrics import read_metrics_file
from bridge.train.testing import (
    tiny_config_container,
    tiny_gpt_provider,
    tiny_optimizer_config,
    tiny_train_config,
    write_tiny_sft_task,
)
from core_utils.testing import run_distributed

SEQ = 32
ITERS = 6
TOL = 1e-5
LORA = {"dim": 4, "alpha": 8.0}


def _config(root: Path, job: dict[str, Any]) -> Any:
    from bridge.train.peft import LoRA

    packed = bool(job.get("packed", False))
    distributed = bool(job.get("distributed_optimizer", False))
    train = tiny_train_config(
        train_iters=ITERS,
        global_batch_size=4,
        micro_batch_size=1 if packed else 2,
        exit_interval=job.get("exit_interval"),
    )
    specs = PackedSequenceSpecs(packed_sequence_size=SEQ) if packed else None
    return tiny_config_container(
        train=train,
        model=tiny_gpt_provider(
            vocab_size=258,
            # 320 rows at TP=1 and TP=2 alike (64 x TP would give 320 and 384, and the
            # extra padded rows would change the softmax).
            make_vocab_size_divisible_by=160,
            seq_length=SEQ,
            tensor_model_parallel_size=job.get("tp", 1),
            pipeline_model_parallel_size=job.get("pp", 1),
            pipeline_dtype=torch.float32,
        ),
        optimizer=tiny_optimizer_config(use_distributed_optimizer=distributed),
        ddp=DistributedDataParallelConfig(
            use_distributed_optimizer=distributed, overlap_grad_reduce=distributed
        ),
        peft=LoRA(**LORA) if job.get("lora") else None,  # type: ignore[arg-type]
        tokenizer=TokenizerConfig(tokenizer_type="ByteLevelTokenizer"),
        dataset=FinetuningDatasetConfig(
            dataset_root=root,
            seq_length=SEQ,
            num_workers=0,
            pin_memory=False,
            dataloader_type="single",
            do_validation=False,
            do_test=False,
            packed_sequence_specs=specs,
        ),
        logger=LoggerConfig(log_interval=1),
        checkpoint=CheckpointConfig(
            save=str(root.parent / job["name"]),
            save_interval=3,
            pretrained_checkpoint=job.get("base"),
        ),
    )


def _optimized_params(optimizer: Any) -> set[int]:
    """ids of the model parameters a megatron optimizer (chained, distributed, ...) updates."""
    found: set[int] = set()
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(sub, "model_float16_groups"):  # distributed optimizer
            groups = list(sub.model_float16_groups) + list(sub.model_fp32_groups)
        elif hasattr(sub, "float16_groups"):  # mixed-precision optimizer
            groups = list(sub.float16_groups) + list(sub.fp32_from_fp32_groups)
        else:
            groups = [group["params"] for group in sub.param_groups]
        found |= {id(param) for group in groups for param in group}
    return found


def _frozen_base_check(rank: int, world: int, distributed: bool) -> dict[str, Any]:
    """Build a LoRA model with the megatron engine: what its grad buffers and optimizer hold."""
    from bridge.train.engine import MegatronEngine
    from bridge.train.engine.initialize import destroy_distributed
    from bridge.train.peft import LoRA, apply_peft
    from bridge.train.testing import tiny_dist_config, tiny_rng_config, tiny_scheduler_config

    provider = tiny_gpt_provider()
    engine = MegatronEngine()
    engine.initialize_distributed(provider, tiny_dist_config(), tiny_rng_config())
    try:
        lora = LoRA(**LORA)  # type: ignore[arg-type]
        ddp = DistributedDataParallelConfig(use_distributed_optimizer=distributed)
        model = engine.setup_model(provider, ddp, pre_wrap_hooks=[lambda c: apply_peft(lora, c)])
        optimizer, _ = engine.setup_optimizer(
            model,
            tiny_optimizer_config(use_distributed_optimizer=distributed),
            tiny_scheduler_config(),
            tiny_train_config(),
        )
        ddp_chunk: Any = model[0]
        inner: torch.nn.Module = ddp_chunk.module
        names = {id(p): n for n, p in inner.named_parameters()}
        trainable = {n for n, p in inner.named_parameters() if p.requires_grad}
        in_buffers = {names[id(p)] for buffer in ddp_chunk.buffers for p in buffer.params}
        in_optimizer = {names[i] for i in _optimized_params(optimizer) if i in names}
        return {
            "trainable": trainable,
            "in_buffers": in_buffers,
            "in_optimizer": in_optimizer,
            "optimizer_types": [
                type(sub).__name__ for sub in getattr(optimizer, "chained_optimizers", [optimizer])
            ],
            "buffer_numel": sum(b.numel for b in ddp_chunk.buffers),
            "trainable_numel": sum(p.numel() for p in inner.parameters() if p.requires_grad),
        }
    finally:
        destroy_distributed()


def _jobs(rank: int, world: int, root: str, jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """The frozen-base checks, then each job's ``pretrain`` in turn."""
    out: dict[str, Any] = {
        "frozen": _frozen_base_check(rank, world, distributed=world > 1),
        "codes": {},
    }
    for job in jobs:
        metrics = Path(root).parent / f"{job['name']}.{job.get('part', 'run')}.{rank}.jsonl"
        out["codes"][f"{job['name']}.{job.get('part', 'run')}"] = pretrain(
            _config(Path(root), job), metrics_file=str(metrics)
        )
    return out


def _losses(tmp: Path, name: str, part: str = "run", rank: int = 0) -> dict[int, float]:
    records = read_metrics_file(tmp / f"{name}.{part}.{rank}.jsonl")
    return {int(r["step"]): r["lm loss"] for r in records if "lm loss" in r}


def _adapters(rank: int, world: int, checkpoints: list[str]) -> list[dict[str, torch.Tensor]]:
    """The global adapter tensors saved in each adapter-only checkpoint."""
    from megatron.core.dist_checkpointing.serialization import load_plain_tensors

    return [
        {
            key: value
            for key, value in load_plain_tensors(path).items()
            if ".adapter." in key and not key.startswith("optim")
        }
        for path in checkpoints
    ]


def _resumed(tmp: Path, name: str, rank: int = 0) -> dict[int, float]:
    """Losses of a run stopped at iteration 3 and resumed (both parts)."""
    return {**_losses(tmp, name, "stop", rank), **_losses(tmp, name, "resume", rank)}


def _stop_and_resume(job: dict[str, Any]) -> list[dict[str, Any]]:
    name = f"{job['name']}-resumed"
    return [
        {**job, "name": name, "part": "stop", "exit_interval": 3},
        {**job, "name": name, "part": "resume"},
    ]


def _assert_close(got: dict[int, float], want: dict[int, float], label: str) -> None:
    assert sorted(got) == sorted(want) == list(range(1, ITERS + 1)), (label, got, want)
    for step, loss in got.items():
        assert abs(loss - want[step]) < TOL, (label, step, loss, want[step])


def _run(tmp_path: Path, single: list[dict[str, Any]], pair: list[dict[str, Any]]) -> Any:
    root = write_tiny_sft_task(tmp_path / "data")
    (one,) = run_distributed(_jobs, 1, str(root), single, timeout=420)
    two = run_distributed(_jobs, 2, str(root), pair, timeout=600) if pair else []
    return one, two


SFT_JOBS: list[dict[str, Any]] = [{"name": "sft"}, {"name": "packed", "packed": True}]


def _lora(name: str, base: Path, **fields: Any) -> dict[str, Any]:
    return {"name": name, "lora": True, "base": str(base), **fields}


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_megatron_sft_and_lora_train_resume_and_match_layouts(tmp_path: Path) -> None:
    base = tmp_path / "sft"  # the SFT run's checkpoint is the LoRA base
    single = [
        *SFT_JOBS,
        *_stop_and_resume({"name": "sft"}),
        _lora("lora", base),
        *_stop_and_resume(_lora("lora", base)),
    ]
    pair = [
        _lora("lora-tp2", base, tp=2),
        _lora("lora-dp2-distopt", base, distributed_optimizer=True),
    ]
    one, two = _run(tmp_path, single, pair)
    assert set(one["codes"].values()) == {0}, one["codes"]
    for rank_result in two:
        assert set(rank_result["codes"].values()) == {0}, rank_result["codes"]

    # The frozen base is in neither megatron's grad buffers nor its optimizer.
    for label, frozen in [("1 rank", one["frozen"])] + [("dist-opt", r["frozen"]) for r in two]:
        assert frozen["trainable"] and all(".adapter." in n for n in frozen["trainable"]), label
        assert frozen["in_buffers"] == frozen["trainable"], label
        assert frozen["in_optimizer"] <= frozen["trainable"], label
        assert frozen["buffer_numel"] < 2 * frozen["trainable_numel"], label  # padding only
    assert one["frozen"]["in_optimizer"] == one["frozen"]["trainable"]
    # The distributed optimizer shards the adapters over the two ranks: together, all of them.
    assert all(r["frozen"]["optimizer_types"] == ["DistributedOptimizer"] for r in two), two
    sharded = [r["frozen"]["in_optimizer"] for r in two]
    assert sharded[0] | sharded[1] == one["frozen"]["trainable"]

    # SFT and packed SFT train (6 iterations are too few for the loss to fall steadily;
    # learning is tests/test_train_finetune_learning.py's); SFT resumes bit for bit.
    for name in ("sft", "packed"):
        losses = _losses(tmp_path, name)
        assert sorted(losses) == list(range(1, ITERS + 1)), (name, losses)
        assert all(math.isfinite(x) for x in losses.values()) and losses[1] != losses[ITERS]
    assert _resumed(tmp_path, "sft-resumed") == _losses(tmp_path, "sft")

    # LoRA trains; the adapter-only checkpoint resumes bit for bit.
    lora = _losses(tmp_path, "lora")
    assert lora[1] != lora[ITERS]
    assert _resumed(tmp_path, "lora-resumed") == lora
    # TP=2 and DP=2 (distributed optimizer): one process's losses and global adapters.
    names = ["lora", "lora-tp2", "lora-dp2-distopt"]
    checkpoints = [str(tmp_path / name / f"iter_{ITERS:07d}") for name in names]
    (saved,) = run_distributed(_adapters, 1, checkpoints, timeout=120)
    reference = saved[0]
    assert len(reference) == 8  # 4 targets x (A, B), the layers stacked in one tensor
    for name, adapters in zip(names[1:], saved[1:], strict=True):
        # The last rank writes the metrics file.
        _assert_close(_losses(tmp_path, name, rank=1), lora, name)
        assert sorted(adapters) == sorted(reference), name
        for key, want in reference.items():
            assert adapters[key].shape == want.shape, (name, key)
            assert float((adapters[key] - want).abs().max()) < TOL, (name, key)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(1800)
def test_megatron_finetuning_resume_matrix(tmp_path: Path) -> None:
    base = tmp_path / "sft"
    single: list[dict[str, Any]] = [
        {"name": "sft"},
        {"name": "packed", "packed": True},
        *_stop_and_resume({"name": "packed", "packed": True}),
        _lora("lora-packed", base, packed=True),
        _lora("lora", base),
        {"name": "packed-ft", "packed": True, "base": str(base)},
    ]
    pair: list[dict[str, Any]] = [
        *_stop_and_resume(_lora("lora-tp2", base, tp=2)),
        _lora("lora-tp2", base, tp=2),
        *_stop_and_resume(_lora("lora-dp2-distopt", base, distributed_optimizer=True)),
        _lora("lora-dp2-distopt", base, distributed_optimizer=True),
        _lora("lora-pp2", base, pp=2),
        # Full finetuning from the base: both layouts start from the same weights (megatron
        # seeds each pipeline stage's initialisation differently).
        {"name": "packed-ft-pp2", "packed": True, "pp": 2, "base": str(base)},
        {"name": "sft-dp2-distopt", "distributed_optimizer": True},
        *_stop_and_resume({"name": "sft-dp2-distopt", "distributed_optimizer": True}),
    ]
    # The 2-rank jobs need the base the 1-rank group saves first.
    one, two = _run(tmp_path, single, pair)
    assert set(one["codes"].values()) == {0}, one["codes"]
    for rank_result in two:
        assert set(rank_result["codes"].values()) == {0}, rank_result["codes"]
    assert _resumed(tmp_path, "packed-resumed") == _losses(tmp_path, "packed")
    lora_packed = _losses(tmp_path, "lora-packed")
    assert sorted(lora_packed) == list(range(1, ITERS + 1))
    assert lora_packed[1] != lora_packed[ITERS]
    for name in ("lora-tp2", "lora-dp2-distopt", "sft-dp2-distopt"):
        assert _resumed(tmp_path, f"{name}-resumed", 1) == _losses(tmp_path, name, rank=1)
    _assert_close(_losses(tmp_path, "sft-dp2-distopt", rank=1), _losses(tmp_path, "sft"), "dp2")
    # Pipeline parallelism (megatron's 1F1B schedule): one process's losses.
    _assert_close(
        _losses(tmp_path, "packed-ft-pp2", rank=1), _losses(tmp_path, "packed-ft"), "packed pp2"
    )
    _assert_close(_losses(tmp_path, "lora-pp2", rank=1), _losses(tmp_path, "lora"), "lora-pp2")
