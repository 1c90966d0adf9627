"""Shared pieces of the bridge-mimo tests: a tiny VLM, its data, a single-process reference.

Test modules cannot import each other (importlib mode), so the helpers live here and reach
the tests through the ``harness`` fixture. Everything runs on CPU with gloo.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import default_collate

import bridge.mimo as mimo

# Small enough that a 4-rank step takes well under a second on a loaded 2-core machine.
CONFIG = mimo.TinyVLMConfig(
    vocab_size=32,
    seq_length=24,
    language_hidden_size=32,
    language_layers=2,
    language_heads=4,
    encoder_hidden_size=32,
    encoder_layers=1,
    encoder_heads=4,
)
GLOBAL_BATCH = 8
MICRO_BATCH = 4
INIT_SEED = 7
DATA_SEED = 5
LR = 0.1
CLIP = 1.0


class VariableMaskDataset:
    """The synthetic dataset with a loss mask whose length differs between samples."""

    def __init__(self, base: mimo.SyntheticImageCaptionDataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = self.base[index]
        mask = sample["loss_mask"].clone()
        keep = 1 + index % 6  # 1..6 of the 6 caption tokens count
        on = mask.nonzero().flatten()
        mask[on[keep:]] = 0.0
        sample["loss_mask"] = mask
        return sample


def make_dataset(variable_mask: bool = False) -> Any:
    base = mimo.SyntheticImageCaptionDataset(
        64,
        image_tokens=CONFIG.image_tokens,
        seq_length=CONFIG.seq_length,
        num_classes=4,
        image_size=CONFIG.image_size,
        channels=CONFIG.channels,
        seed=3,
    )
    return VariableMaskDataset(base) if variable_mask else base


def make_layout(desc: Mapping[str, Mapping[str, Any]]) -> mimo.MimoLayout:
    return mimo.MimoLayout({name: mimo.ModulePlacement(**spec) for name, spec in desc.items()})


def sgd(_name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    # SGD keeps the comparison linear in the gradients: an Adam update divides by the
    # root of the squared gradient and amplifies float round-off where gradients are ~0.
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def full_parameters(model: Any, infra: mimo.MegatronMIMOInfra) -> dict[str, torch.Tensor]:
    """This rank's parameters with tensor-parallel shards gathered (collective per module)."""
    out = {}
    for name, param in mimo.unwrap_megatron_mimo_model(model).named_parameters():
        module = (
            infra.language_module_name if name.startswith("language_model") else name.split(".")[1]
        )
        pgs = infra.pg_collections[module]
        assert pgs is not None  # this rank holds the parameter, so it runs the module
        tensor = param.detach()
        if getattr(param, "tensor_model_parallel", False) and pgs.tp.size() > 1:
            parts = [torch.empty_like(tensor) for _ in range(pgs.tp.size())]
            dist.all_gather(parts, tensor.contiguous(), group=pgs.tp)
            tensor = torch.cat(parts, dim=param.partition_dim)
        out[name] = tensor.clone()
    return out


def build_run(
    desc: Mapping[str, Mapping[str, Any]],
    *,
    per_token_loss: bool = False,
    communicator: Any = "auto",
    global_batch: int = GLOBAL_BATCH,
    micro_batch: int = MICRO_BATCH,
    optimizer_factory: Any = sgd,
    variable_mask: bool = False,
    consumed_samples: int = 0,
) -> SimpleNamespace:
    """Infra, model, optimizer, step and loader of one layout on this rank."""
    infra = mimo.build_megatron_mimo_infra(make_layout(desc))
    model = mimo.build_mimo_model(infra, init_seed=INIT_SEED, **mimo.tiny_vlm_specs(CONFIG, infra))
    optimizer = mimo.build_multimodule_optimizer(model, infra, optimizer_factory, clip_grad=CLIP)
    if communicator == "megatron-compat":
        communicator = mimo.MegatronBridgeModuleCommunicator(
            infra, micro_batch, CONFIG.language_hidden_size, allow_cpu_compat=True
        )
    step = mimo.MimoTrainStep(
        model,
        infra,
        optimizer,
        global_batch_size=global_batch,
        micro_batch_size=micro_batch,
        per_token_loss=per_token_loss,
        communicator=communicator,
    )
    data = mimo.MimoDataLoader.for_infra(
        make_dataset(variable_mask),
        infra,
        global_batch_size=global_batch,
        micro_batch_size=micro_batch,
        seed=DATA_SEED,
        consumed_samples=consumed_samples,
    )
    return SimpleNamespace(infra=infra, model=model, optimizer=optimizer, step=step, data=data)


def close_run(run: SimpleNamespace) -> None:
    run.step.close()
    run.infra.destroy()


def train_layout(
    rank: int,
    world_size: int,
    desc: Mapping[str, Mapping[str, Any]],
    steps: int,
    kwargs: Mapping[str, Any],
) -> dict[str, Any]:
    """Rank body: train ``steps`` steps, return losses and gathered parameters."""
    run = build_run(desc, **kwargs)
    result = mimo.train_mimo(run.step, run.data, train_iters=steps)
    params = full_parameters(run.model, run.infra)
    close_run(run)
    return {"losses": result.losses, "params": params}


def reference_training(
    rank: int,
    world_size: int,
    steps: int,
    per_token_loss: bool,
    variable_mask: bool,
    global_batch: int = GLOBAL_BATCH,
    micro_batch: int = MICRO_BATCH,
) -> dict[str, Any]:
    """The same model and data on one process, trained by hand on whole global batches.

    Shares only model construction with the library (so both start from the same weights);
    the forward over the whole batch, the loss normalisation, clipping and the optimizer are
    written here independently.
    """
    assert world_size == 1
    layout = mimo.MimoLayout(
        {"vision": mimo.ModulePlacement(ranks=[0]), "language": mimo.ModulePlacement(ranks=[0])}
    )
    infra = mimo.build_megatron_mimo_infra(layout)
    model = mimo.build_mimo_model(infra, init_seed=INIT_SEED, **mimo.tiny_vlm_specs(CONFIG, infra))
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=LR, momentum=0.9)
    dataset = make_dataset(variable_mask)
    order = mimo.MimoDataLoader(
        dataset,
        global_batch_size=global_batch,
        micro_batch_size=micro_batch,
        dp_rank=0,
        dp_size=1,
        seed=DATA_SEED,
    )
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        micro_batches = [
            default_collate([dataset[i] for i in indices])
            for indices in order.step_indices(step * global_batch)
        ]
        total_tokens = sum(float(b["loss_mask"].sum()) for b in micro_batches)
        step_loss = 0.0
        for batch in micro_batches:
            per_token, _ = model(
                input_ids=batch["input_ids"],
                position_ids=torch.arange(CONFIG.seq_length).expand_as(batch["input_ids"]),
                loss_mask=batch["loss_mask"],
                labels=batch["labels"],
                modality_inputs=batch["modality_inputs"],
            )
            masked = (per_token * batch["loss_mask"]).sum()
            if per_token_loss:
                loss = masked / total_tokens
            else:
                loss = masked / batch["loss_mask"].sum() / len(micro_batches)
            loss.backward()
            step_loss += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        optimizer.step()
        losses.append(step_loss)
    result = {
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }
    infra.destroy()
    return result


@pytest.fixture(scope="session")
def harness() -> SimpleNamespace:
    """The helpers above, for test modules."""
    return SimpleNamespace(
        CONFIG=CONFIG,
        GLOBAL_BATCH=GLOBAL_BATCH,
        MICRO_BATCH=MICRO_BATCH,
        make_dataset=make_dataset,
        make_layout=make_layout,
        build_run=build_run,
        close_run=close_run,
        train_layout=train_layout,
        reference_training=reference_training,
        full_parameters=full_parameters,
        sgd=sgd,
    )
