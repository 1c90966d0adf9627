"""LoRA on megatron's parallel linears: only adapters train and reach the optimizer, TP=2
and DP=2 equal one process (losses and the full adapters), and merging the adapters into
the base weights gives the logits of base + adapters.

One 1-rank launch computes the reference and the single-process checks; one 2-rank launch
runs TP=2 and DP=2. Steps through megatron-core's engine equal steps of plain
``torch.optim.Adam`` on the same LoRA model and batch (within 1e-6).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from bridge.train.convert import AutoBridge
from bridge.train.engine import MegatronEngine
from bridge.train.loop.bare_loop import train_steps
from bridge.train.peft import LoRA, LoRAAdapter, apply_peft, merge_adapters
from bridge.train.testing import (
    tiny_dist_config,
    tiny_gpt_provider,
    tiny_mock_iterator,
    tiny_optimizer_config,
    tiny_rng_config,
    tiny_scheduler_config,
    tiny_train_config,
)
from core_utils.testing import run_distributed

ITERS = 5
TOL = 1e-5
LORA = {"dim": 4, "alpha": 8.0}


def _build(tp: int) -> tuple[Any, Any, list[torch.nn.Module]]:
    provider = tiny_gpt_provider(tensor_model_parallel_size=tp)
    engine = MegatronEngine()
    engine.initialize_distributed(provider, tiny_dist_config(), tiny_rng_config())
    lora = LoRA(**LORA)  # type: ignore[arg-type]
    model = engine.setup_model(provider, pre_wrap_hooks=[lambda c: apply_peft(lora, c)])
    return provider, engine, model


def _full_adapters(model: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Every adapter's full A and B (shards gathered over the tensor-parallel group)."""
    out: dict[str, torch.Tensor] = {}
    for name, module in model[0].named_modules():
        if not isinstance(module, LoRAAdapter):
            continue
        group = module.tp_group
        for part, layer in (("A", module.linear_in), ("B", module.linear_out)):
            weight = layer.weight.detach()
            split_dim = None
            if module.kind == "column" and part == "B":
                split_dim = 0
            elif module.kind == "row" and part == "A":
                split_dim = 1
            if split_dim is not None and group.size() > 1:
                parts = [torch.empty_like(weight) for _ in range(group.size())]
                torch.distributed.all_gather(parts, weight.contiguous(), group=group)
                weight = torch.cat(parts, dim=split_dim)
            out[f"{name}.{part}"] = weight.clone()
    return out


def _train(tp: int, mbs: int, gbs: int) -> dict[str, Any]:
    provider, engine, model = _build(tp)
    train = tiny_train_config(micro_batch_size=mbs, global_batch_size=gbs, train_iters=ITERS)
    optimizer, scheduler = engine.setup_optimizer(
        model, tiny_optimizer_config(), tiny_scheduler_config(), train
    )
    trainable = {n for n, p in model[0].named_parameters() if p.requires_grad}
    names = {id(p): n for n, p in model[0].named_parameters()}
    in_optimizer = {names[id(p)] for p in optimizer.get_parameters()}
    base_before = {
        n: p.detach().clone() for n, p in model[0].named_parameters() if not p.requires_grad
    }
    result = train_steps(
        engine,
        model,
        optimizer,
        scheduler,
        tiny_mock_iterator(train),
        train_iters=ITERS,
        global_batch_size=gbs,
        micro_batch_size=mbs,
        seq_length=provider.seq_length,
    )
    base_same = all(
        torch.equal(p.detach(), base_before[n])
        for n, p in model[0].named_parameters()
        if n in base_before
    )
    return {
        "losses": result.losses,
        "adapters": _full_adapters(model),
        "trainable": trainable,
        "in_optimizer": in_optimizer,
        "base_same": base_same,
        "model": model,
        "provider": provider,
        "train": train,
    }


def _single(rank: int, world: int) -> dict[str, Any]:
    from bridge.train.engine.initialize import destroy_distributed

    out = _train(1, 2, 4)
    model = out.pop("model")
    train = out.pop("train")
    bridge = AutoBridge.from_provider(out.pop("provider"))
    # Merge: the plain model gives the logits base + adapters gave.
    batch = next(tiny_mock_iterator(train))
    inner = model[0].module
    inner.eval()
    with torch.no_grad():
        before = inner(batch["tokens"], batch["position_ids"], None)
        out["exported"] = dict(bridge.export_hf_weights(model))  # adapters folded in
        out["adapters_after_export"] = sum(isinstance(m, LoRAAdapter) for m in inner.modules())
        merge_adapters(model)
        after = inner(batch["tokens"], batch["position_ids"], None)
    out["merged_export"] = dict(bridge.export_hf_weights(model))
    out["merge_diff"] = float((before - after).abs().max())
    out["adapters_left"] = sum(isinstance(m, LoRAAdapter) for m in inner.modules())
    out["peft_records_left"] = [n for m in (model[0], inner) for n in vars(m) if "peft" in n]
    out["merged_keys"] = sorted(inner.state_dict())
    out["adapter_count"] = len(out["adapters"]) // 2
    destroy_distributed()
    # The plain model's parameter names are those a LoRA-free model has.
    provider = tiny_gpt_provider()
    engine = MegatronEngine()
    engine.initialize_distributed(provider, tiny_dist_config(), tiny_rng_config())
    plain = engine.setup_model(provider, wrap_with_ddp=False)[0]
    out["plain_keys"] = sorted(plain.state_dict())
    destroy_distributed()
    out["engine_vs_adam"] = _engine_vs_plain_adam()
    destroy_distributed()
    return out


def _engine_vs_plain_adam(steps: int = 3) -> dict[str, Any]:
    """Steps through megatron-core's engine (its DDP grad buffers, param groups, scheduler
    and optimizer) against plain ``torch.optim.Adam`` on the unwrapped LoRA model, same
    weights and batch: the largest adapter difference and the movement."""
    provider, engine, model = _build(1)
    train = tiny_train_config(micro_batch_size=2, global_batch_size=2, train_iters=steps)
    optimizer, scheduler = engine.setup_optimizer(
        model,
        tiny_optimizer_config(clip_grad=0.0, weight_decay=0.0),
        tiny_scheduler_config(lr_decay_style="constant", lr_warmup_iters=0),
        train,
    )
    batch = next(tiny_mock_iterator(train))
    inner: Any = model[0].module
    params = {n: p for n, p in inner.named_parameters() if p.requires_grad}
    start = {n: p.detach().clone() for n, p in params.items()}
    result = train_steps(
        engine,
        model,
        optimizer,
        scheduler,
        itertools.repeat(batch),
        train_iters=steps,
        global_batch_size=2,
        micro_batch_size=2,
        seq_length=provider.seq_length,
    )
    through_engine = {n: p.detach().clone() for n, p in params.items()}
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(start[name])
    config = optimizer.config
    reference = torch.optim.Adam(
        list(params.values()),
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
    )
    mask = batch["loss_mask"].float()
    for _ in range(steps):
        losses = inner(
            batch["tokens"],
            batch["position_ids"],
            batch.get("attention_mask"),
            labels=batch["labels"],
            loss_mask=batch["loss_mask"],
        )
        loss = (losses.float() * mask).sum() / mask.sum()
        # autograd.grad: the DDP wrapper's hooks would move .grad into its buffer.
        grads = torch.autograd.grad(loss, list(params.values()))
        for param, grad in zip(params.values(), grads, strict=True):
            param.grad = grad
        reference.step()
    return {
        "lr": config.lr,
        "lrs": result.learning_rates,
        "max_diff": max(
            float((through_engine[n] - p.detach()).abs().max()) for n, p in params.items()
        ),
        "min_moved": min(float((through_engine[n] - start[n]).abs().max()) for n in params),
    }


def _parallel(rank: int, world: int) -> dict[str, Any]:
    from bridge.train.engine.initialize import destroy_distributed

    results = {}
    for name, tp, mbs, gbs in (("tp2", 2, 2, 4), ("dp2", 1, 1, 4)):
        out = _train(tp, mbs, gbs)
        # A live LoRA model saved to Hugging Face names: every rank folds its shards' adapters.
        out["exported"] = dict(
            AutoBridge.from_provider(out["provider"]).export_hf_weights(out["model"])
        )
        for key in ("model", "provider", "train", "trainable", "in_optimizer"):
            out.pop(key)
        results[name] = out
        destroy_distributed()
    return results


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_lora_trains_adapters_only_equal_in_every_layout_and_merges() -> None:
    (single,) = run_distributed(_single, 1, timeout=200)
    # 2 layers x (qkv, proj, fc1, fc2)
    assert single["adapter_count"] == 8
    assert single["trainable"] == single["in_optimizer"]
    assert single["trainable"] and all(".adapter." in n for n in single["trainable"])
    assert single["base_same"]
    assert single["merge_diff"] < TOL
    assert single["adapters_left"] == 0 and single["merged_keys"] == single["plain_keys"]
    assert single["peft_records_left"] == []
    # AutoBridge saves a model with live adapters as the merged model, leaving it as it was.
    assert single["adapters_after_export"] == single["adapter_count"]
    assert sorted(single["exported"]) == sorted(single["merged_export"])
    assert "transformer.h.0.attn.c_attn.weight" in single["exported"]
    for name, tensor in single["merged_export"].items():
        assert torch.equal(single["exported"][name], tensor), name
    assert all(b.abs().sum() > 0 for k, b in single["adapters"].items() if k.endswith(".B"))
    # The engine's update of every adapter is plain Adam's (and every adapter moves).
    versus = single["engine_vs_adam"]
    assert versus["lrs"] == [versus["lr"]] * 3, versus
    assert versus["max_diff"] < 1e-6, versus
    assert versus["min_moved"] > 0.5 * versus["lrs"][0], versus

    results = run_distributed(_parallel, 2, timeout=300)
    for name in ("tp2", "dp2"):
        for rank_result in results:
            got = rank_result[name]
            assert got["base_same"]
            for step, (a, b) in enumerate(zip(got["losses"], single["losses"], strict=True)):
                assert abs(a - b) < TOL, (name, step, a, b)
            for key, ref in single["adapters"].items():
                diff = float((got["adapters"][key] - ref).abs().max())
                assert diff < TOL, (name, key, diff)
        exported = results[0][name]["exported"]  # rank 0's, gathered over TP at tp2
        for key, ref in single["exported"].items():
            diff = float((exported[key] - ref).abs().max())
            assert diff < TOL, (name, key, diff)


def test_lora_config_errors() -> None:
    with pytest.raises(ValueError, match=r"peft\.dim"):
        LoRA(dim=0)
    with pytest.raises(ValueError, match=r"peft\.lora_B_init_method"):
        LoRA(lora_B_init_method="xavier")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"peft\.dropout must be in \[0, 1\)"):
        LoRA(dropout=1.0)
    with pytest.raises(ValueError, match=r"peft\.dropout_position must be 'pre' or 'post'"):
        LoRA(dropout_position="mid")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"peft\.lora_A_init_method must be"):
        LoRA(lora_A_init_method="zero")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"peft\.target_modules is empty"):
        LoRA(target_modules=[])


def test_lora_refuses_targets_that_are_no_parallel_linear_or_match_nothing() -> None:
    model = torch.nn.Sequential()
    model.add_module("norm", torch.nn.LayerNorm(2))
    with pytest.raises(TypeError, match="LoRA target norm is a LayerNorm; LoRA adapts megatron"):
        LoRA(target_modules=["norm"])(model)
    with pytest.raises(ValueError, match=r"peft\.target_modules=\['nothing'\] matched no layer"):
        LoRA(target_modules=["nothing"])(model)


def _prefixes_seen(model: torch.nn.Module) -> list[str]:
    """The module paths a PEFT transform is given for ``model``."""
    from bridge.train.peft import PEFT

    class Record(PEFT):
        def __init__(self) -> None:
            self.seen: list[str] = []

        def transform(self, module: torch.nn.Module, name: str, prefix: str) -> torch.nn.Module:
            self.seen.append(prefix)
            return module

    record = Record()
    record(model)
    return record.seen


def test_a_peft_transform_may_replace_a_module_and_eval_when_not_training() -> None:
    """A transform's returned module takes the old one's place (its new parameters stay
    trainable, the base is frozen); ``training=False`` leaves the model in eval mode."""
    from bridge.train.peft import PEFT

    class Swap(PEFT):
        def transform(self, module: torch.nn.Module, name: str, prefix: str) -> torch.nn.Module:
            return torch.nn.Linear(2, 3) if name == "proj" else module

    model = torch.nn.Sequential()
    model.add_module("proj", torch.nn.Linear(2, 2))
    model.add_module("norm", torch.nn.LayerNorm(2))
    Swap()(model, training=False)
    proj, norm = model.get_submodule("proj"), model.get_submodule("norm")
    assert isinstance(proj, torch.nn.Linear) and proj.out_features == 3
    assert all(p.requires_grad for p in proj.parameters())
    assert not any(p.requires_grad for p in norm.parameters())
    assert not model.training


def test_peft_transforms_see_global_layer_numbers() -> None:
    """A pipeline stage numbers its layers from 0; transforms get the global numbers."""

    class Layer(torch.nn.Module):
        def __init__(self, layer_number: int) -> None:
            super().__init__()
            self.layer_number = layer_number  # megatron's: global and 1-based
            self.linear_qkv = torch.nn.Linear(2, 2)

    class Stage(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.decoder = torch.nn.Module()
            self.decoder.layers = torch.nn.ModuleList([Layer(3), Layer(4)])  # second stage

    seen = _prefixes_seen(Stage())
    assert "decoder.layers.2.linear_qkv" in seen
    assert "decoder.layers.3.linear_qkv" in seen
    assert not any(p.startswith(("decoder.layers.0", "decoder.layers.1")) for p in seen)


def test_peft_transforms_see_global_expert_numbers() -> None:
    """An expert-parallel rank numbers its experts from 0; transforms get the global numbers,
    so LoRA draws an expert's adapter from the same seed in every expert-parallel layout."""

    class Rank:
        def rank(self) -> int:
            return 1  # the second of two expert-parallel ranks

    class Experts(torch.nn.Module):  # megatron's SequentialMLP: what the walk reads of it
        def __init__(self) -> None:
            super().__init__()
            self.num_local_experts = 2
            self.ep_group = Rank()
            self.local_experts = torch.nn.ModuleList([torch.nn.Module() for _ in range(2)])
            for expert in self.local_experts:
                expert.linear_fc1 = torch.nn.Linear(2, 2)

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer_number = 1
            self.mlp = torch.nn.Module()
            self.mlp.experts = Experts()

    class Stage(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.decoder = torch.nn.Module()
            self.decoder.layers = torch.nn.ModuleList([Layer()])

    seen = _prefixes_seen(Stage())
    assert "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1" in seen
    assert "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1" in seen
    assert not any(".local_experts.0." in p or ".local_experts.1." in p for p in seen)


MOE = {"num_layers": 2, "num_moe_experts": 4, "moe_router_topk": 2, "add_bias_linear": False}


def _expert_adapters(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Each expert adapter's A on this rank, keyed by the expert's global number."""
    provider = tiny_gpt_provider(**MOE, expert_model_parallel_size=world)
    engine = MegatronEngine()
    engine.initialize_distributed(provider, tiny_dist_config(), tiny_rng_config())
    lora = LoRA(**LORA)  # type: ignore[arg-type]
    model = engine.setup_model(provider, pre_wrap_hooks=[lambda c: apply_peft(lora, c)])
    out: dict[str, torch.Tensor] = {}
    for name, module in model[0].named_modules():
        if isinstance(module, LoRAAdapter) and ".local_experts." in name:
            head, _, rest = name.partition(".local_experts.")
            local, _, tail = rest.partition(".")
            global_number = rank * (MOE["num_moe_experts"] // world) + int(local)
            out[f"{head}.{global_number}.{tail}"] = module.linear_in.weight.detach().clone()
    return out


def test_lora_expert_adapters_start_equal_at_every_expert_parallel_size() -> None:
    """An expert's adapter is drawn from its global expert number: EP=2 starts as EP=1."""
    (one,) = run_distributed(_expert_adapters, 1, timeout=300)
    two = run_distributed(_expert_adapters, 2, timeout=300)
    both = {**two[0], **two[1]}
    assert set(both) == set(one) and len(one) == 2 * 2 * MOE["num_moe_experts"]
    assert not [key for key in one if not torch.equal(one[key], both[key])]


def _adapter_options(rank: int, world: int) -> dict[str, Any]:
    """A ``kaiming`` / ``post`` LoRA model's adapters at creation, and one adapted layer's
    output in eval and train mode next to the hand computation of ``W x + s * drop(B A x)``
    (and of ``pre``'s ``W x + s * B A drop(x)``) under the same random seed."""
    from bridge.train.engine.initialize import destroy_distributed

    provider = tiny_gpt_provider()
    engine = MegatronEngine()
    engine.initialize_distributed(provider, tiny_dist_config(), tiny_rng_config())
    lora = LoRA(
        target_modules=["linear_fc1", "linear_fc2"],
        dim=32,
        alpha=8.0,
        dropout=0.5,
        dropout_position="post",
        lora_A_init_method="kaiming",
    )
    model: Any = engine.setup_model(
        provider, wrap_with_ddp=False, pre_wrap_hooks=[lambda c: apply_peft(lora, c)]
    )[0]
    out: dict[str, Any] = {"A": {}, "B": {}}
    for name, module in model.named_modules():
        if isinstance(module, LoRAAdapter):
            out["A"][name] = module.linear_in.weight.detach().clone()
            out["B"][name] = module.linear_out.weight.detach().clone()
    layer = model.decoder.layers[0].mlp.linear_fc2  # row-parallel, [32, 128], no bias added
    adapter = layer.adapter
    with torch.no_grad():
        adapter.linear_out.weight.normal_(generator=torch.Generator().manual_seed(3))
    a, b, scale = adapter.linear_in.weight.detach(), adapter.linear_out.weight.detach(), 8 / 32
    x = torch.randn(5, 2, 128, generator=torch.Generator().manual_seed(4))
    base = torch.nn.functional.linear(x, layer.weight.detach())
    branch = x @ a.T @ b.T
    drop = torch.nn.functional.dropout
    with torch.no_grad():
        model.eval()
        out["eval"] = (layer(x)[0], base + scale * branch)
        model.train()
        torch.manual_seed(5)
        got = layer(x)[0]
        torch.manual_seed(5)
        post = base + scale * drop(branch, 0.5, training=True)
        torch.manual_seed(5)
        pre = base + scale * (drop(x, 0.5, training=True) @ a.T @ b.T)
        out["train"] = (got, post, pre)
    destroy_distributed()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_lora_kaiming_init_and_post_dropout_follow_the_fields() -> None:
    """``lora_A_init_method="kaiming"`` draws A as torch's Linear does (uniform within
    ``1/sqrt(in)``), B starts at zero; ``dropout_position="post"`` drops the branch's
    output in training (not its input) and nothing in eval mode."""
    (out,) = run_distributed(_adapter_options, 1, timeout=240)
    assert len(out["A"]) == 4  # 2 layers x (fc1, fc2)
    for name, a in out["A"].items():
        bound = 1 / a.shape[1] ** 0.5  # kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in))
        assert float(a.abs().max()) <= bound, name
        # Uniform: std bound/sqrt(3) (xavier_normal_ would give sqrt(2/(in+dim)), 1.3x or more)
        assert abs(float(a.std()) / (bound / 3**0.5) - 1) < 0.1, name
        assert not out["B"][name].any(), name
    got, want = out["eval"]
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    got, post, pre = out["train"]
    assert torch.allclose(got, post, atol=1e-5, rtol=0)
    assert not torch.allclose(got, pre, atol=1e-3, rtol=0)
