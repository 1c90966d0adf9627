"""megatron-core's engine trains correctly through the seam: DP=2 and TP=2 equal one
process, gradient accumulation equals a larger micro-batch, the optimizer's step keeps
megatron's contract (global grad norm, clipping as torch clips, zero counts, no weight decay
on biases and norms, skipped steps on fp16 overflow), bf16 trains on fp32 main parameters,
norms are right under tensor parallelism.

On CPU every run is under core-utils' CUDA emulation (entered by the engine). One 1-rank
launch computes the single-process references and checks the optimizer contract; one 2-rank
launch runs DP=2, DP=2 with overlapped bucketed reduction, and TP=2 over gloo, plus the
cross-rank reductions. Each launch re-initialises megatron's parallel state per run. That
the tied output layer's copy of the embedding (``shared``) is counted once in the grad norm
is checked by the pipeline layouts of tests/test_megatron_engine_layouts.py (their grad
norms equal one process's), the only layouts where that copy exists.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from bridge.config import DistributedDataParallelConfig
from bridge.train import (
    calc_dtensor_params_l2_norm,
    calc_params_l2_norm,
    forward_step,
    logical_and_across_model_parallel_group,
    prepare_forward_step_func,
    reduce_max_stat_across_model_parallel_group,
)
from bridge.train.engine import MegatronEngine
from bridge.train.loop.bare_loop import train_steps
from bridge.train.state import GlobalState
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

ITERS = 6
TOL = 1e-5


def _setup(tp: int = 1, ddp=None, align_grad_reduce: bool = True, **provider_overrides):
    provider = tiny_gpt_provider(tensor_model_parallel_size=tp, **provider_overrides)
    engine = MegatronEngine()
    engine.initialize_distributed(provider, tiny_dist_config(), tiny_rng_config())
    model = engine.setup_model(provider, ddp, align_grad_reduce=align_grad_reduce)
    return provider, engine, model


def _grad(param: torch.Tensor) -> torch.Tensor:
    """``param.grad``, which the caller has set (mypy sees ``Tensor | None``)."""
    assert param.grad is not None
    return param.grad


def _train(
    tp: int, mbs: int, gbs: int, ddp=None, align_grad_reduce: bool = True, **provider_overrides
) -> dict:
    provider, engine, model = _setup(tp, ddp, align_grad_reduce, **provider_overrides)
    train = tiny_train_config(micro_batch_size=mbs, global_batch_size=gbs, train_iters=ITERS)
    optimizer, scheduler = engine.setup_optimizer(
        model, tiny_optimizer_config(bf16=provider.bf16), tiny_scheduler_config(), train
    )
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
    return {
        "losses": result.losses,
        "grad_norms": result.grad_norms,
        "lrs": result.learning_rates,
        "ok": result.update_successful,
        "params_norm": calc_params_l2_norm(model, provider),
        "dtypes": sorted({str(p.dtype) for p in model[0].parameters()}),
        "main_dtypes": sorted({str(p.dtype) for p in optimizer.get_parameters()}),
        # dist.align_grad_reduce: the schedule launches the reduction (megatron's rule).
        "grad_sync_func": provider.grad_sync_func is not None,
    }


def _optimizer_contract() -> dict:
    """One step on a fresh model, checked against torch's clip_grad_norm_ on copies.

    Untied output weights, so the embedding rows of tokens absent from the batch get
    exactly zero gradient: the zero count is then known, not a numerical accident.
    """
    _, engine, model = _setup(share_embeddings_and_output_weights=False)
    train = tiny_train_config()
    optimizer, _ = engine.setup_optimizer(
        model,
        tiny_optimizer_config(clip_grad=0.05),
        tiny_scheduler_config(lr_warmup_iters=0),
        train,
    )
    iterator = tiny_mock_iterator(train)
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    step = prepare_forward_step_func(forward_step, GlobalState())
    engine.forward_backward_func(
        forward_step_func=step,
        data_iterator=iterator,
        model=model,
        num_microbatches=2,
        seq_length=16,
        micro_batch_size=2,
    )
    names = {id(p): n for n, p in model[0].named_parameters()}
    params = [p for p in model[0].parameters() if p.requires_grad]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for c, p in zip(copies, params, strict=True):
        c.grad = p.main_grad.detach().clone()
    expected_zeros = sum(int((_grad(c) == 0).sum()) for c in copies)
    expected_norm = float(torch.nn.utils.clip_grad_norm_(copies, max_norm=0.05))
    before = [p.detach().clone() for p in params]
    ok, grad_norm, num_zeros = optimizer.step()
    # fp32: megatron's optimizer steps the model parameters themselves, on .grad (the DDP
    # buffer's main_grad, clipped in place).
    no_decay = sorted(
        names[id(p)]
        for group in optimizer.param_groups
        if group["wd_mult"] == 0.0
        for p in group["params"]
    )
    decays = sorted({float(group["weight_decay"]) for group in optimizer.param_groups})
    return {
        "ok": ok,
        "grad_norm": grad_norm,
        "expected_norm": expected_norm,
        "num_zeros": num_zeros,
        "expected_zeros": expected_zeros,
        "clipped_like_torch": all(
            torch.allclose(_grad(p), _grad(c), rtol=1e-5, atol=1e-8)
            for p, c in zip(params, copies, strict=True)
        ),
        "updated": all(not torch.equal(b, p.detach()) for b, p in zip(before, params, strict=True)),
        "no_decay": no_decay,
        "decays": decays,
        "scheduler_lr": [float(g["lr"]) for g in optimizer.param_groups],
    }


def _state_round_trip() -> bool:
    """Saving optimizer state and model, stepping, restoring and re-stepping gives the same."""
    _, engine, model = _setup()
    train = tiny_train_config()
    optimizer, scheduler = engine.setup_optimizer(
        model, tiny_optimizer_config(), tiny_scheduler_config(), train
    )
    batches = list(_take(tiny_mock_iterator(train), 6))

    def one_step(batch_pair):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        engine.forward_backward_func(
            forward_step_func=lambda it, m: forward_step(None, it, m),
            data_iterator=iter(batch_pair),
            model=model,
            num_microbatches=2,
            seq_length=16,
            micro_batch_size=2,
        )
        optimizer.step()
        scheduler.step(4)

    one_step(batches[0:2])
    saved_model = copy.deepcopy(model[0].state_dict())
    saved_opt = copy.deepcopy(optimizer.state_dict())
    one_step(batches[2:4])
    after_first = [p.detach().clone() for p in model[0].parameters()]
    model[0].load_state_dict(saved_model)
    optimizer.load_state_dict(saved_opt)
    one_step(batches[2:4])
    return all(torch.equal(a, p) for a, p in zip(after_first, model[0].parameters(), strict=True))


def _sharded_state_keys() -> list[str]:
    """Optimizer state mapped onto the model's sharded tensors (what checkpoints save)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from bridge.train.checkpointing.state_dict import (
        allocate_optimizer_state,
        model_sharded_state_dict,
        optimizer_sharded_state_dict,
    )

    _, engine, model = _setup()
    train = tiny_train_config()
    optimizer, _ = engine.setup_optimizer(
        model, tiny_optimizer_config(), tiny_scheduler_config(), train
    )
    allocate_optimizer_state(optimizer)
    sharded = optimizer_sharded_state_dict(
        optimizer, model_sharded_state_dict(model), is_loading=True
    )
    return sorted(v.key for v in nested_values(sharded) if isinstance(v, ShardedTensor))


def _take(iterator, n):
    for _ in range(n):
        yield next(iterator)


def _fp16_loss_scaling() -> dict:
    """megatron's fp16 optimizer: an overflowing step is skipped and backs the loss scale
    off; a clean step unscales the gradients and updates the fp32 main parameters, which
    are copied back into the fp16 model."""
    _, engine, model = _setup(fp16=True, params_dtype=torch.float16)
    config = tiny_optimizer_config(fp16=True, initial_loss_scale=256.0, hysteresis=1, clip_grad=0.0)
    optimizer, _ = engine.setup_optimizer(
        model, config, tiny_scheduler_config(lr_warmup_iters=0), tiny_train_config()
    )
    (inner,) = optimizer.chained_optimizers
    params = [p for group in inner.float16_groups for p in group]
    mains = [p for group in inner.fp32_from_float16_groups for p in group]
    before = [p.detach().clone() for p in params]

    def step_with_main_grads(first: float, rest: float) -> tuple:
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        for index, param in enumerate(params):
            param.main_grad.fill_(first if index == 0 else rest)
        return optimizer.step()

    skipped = step_with_main_grads(float("inf"), 1.0)
    unchanged = all(torch.equal(b, p) for b, p in zip(before, params, strict=True))
    scale_after_overflow = float(optimizer.get_loss_scale())
    ok = step_with_main_grads(128.0, 128.0)  # 1.0 after unscaling by 128
    return {
        "skipped": skipped,
        "unchanged": unchanged,
        "scale_after_overflow": scale_after_overflow,
        "ok": ok[0],
        "model_fp16": {p.dtype for p in params} == {torch.float16},
        "main_fp32": {m.dtype for m in mains} == {torch.float32},
        "model_is_main_in_fp16": all(
            torch.equal(p, m.half()) for p, m in zip(params, mains, strict=True)
        ),
        "moved": not torch.equal(before[0], params[0].detach()),
    }


def _non_finite_gradients(**provider: Any) -> dict:
    """A NaN gradient skips the update (fp32 and bf16, where megatron's optimizer itself
    would step on it; see ``skip_non_finite_updates``); the next clean step updates."""
    _, engine, model = _setup(**provider)
    optimizer, _ = engine.setup_optimizer(
        model,
        tiny_optimizer_config(bf16=bool(provider.get("bf16"))),
        tiny_scheduler_config(lr_warmup_iters=0),
        tiny_train_config(),
    )
    params = [p for p in model[0].parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]

    def step_with_main_grads(first: float) -> tuple:
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        for index, param in enumerate(params):
            param.main_grad.fill_(first if index == 0 else 1e-3)
        return optimizer.step()

    ok, grad_norm, _ = step_with_main_grads(float("nan"))
    unchanged = all(torch.equal(b, p) for b, p in zip(before, params, strict=True))
    clean = step_with_main_grads(1e-3)
    return {
        "ok": ok,
        "grad_norm_is_nan": grad_norm is not None and math.isnan(grad_norm),
        "unchanged": unchanged,
        "clean_ok": clean[0],
        "moved": not torch.equal(before[0], params[0].detach()),
    }


def _single_rank(rank: int, world: int) -> dict:
    return {
        "mb4": _train(tp=1, mbs=4, gbs=4),
        "ga2": _train(tp=1, mbs=2, gbs=4),
        "contract": _optimizer_contract(),
        "round_trip": _state_round_trip(),
        "sharded_keys": _sharded_state_keys(),
        "fp16": _fp16_loss_scaling(),
        "nan_fp32": _non_finite_gradients(),
        "nan_bf16": _non_finite_gradients(bf16=True, params_dtype=torch.bfloat16),
        "bf16": _train(tp=1, mbs=2, gbs=4, bf16=True, params_dtype=torch.bfloat16),
    }


def _dtensor_norm() -> tuple[float, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full_a = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    full_b = torch.ones(5)
    a = distribute_tensor(full_a, mesh, [Shard(0)])
    b = distribute_tensor(full_b, mesh, [Replicate()])
    expected = math.sqrt(float(full_a.pow(2).sum() + full_b.pow(2).sum()))
    return calc_dtensor_params_l2_norm([a, b]), expected


def _checksum(module: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in module.parameters()))


def _data_parallel_init() -> dict:
    """Same seed on every DP rank by default; data_parallel_random_init differs, then broadcasts."""
    provider = tiny_gpt_provider()
    engine = MegatronEngine()
    engine.initialize_distributed(provider, tiny_dist_config(), tiny_rng_config())
    same_seed = _checksum(provider.provide())
    engine.initialize_distributed(
        provider, tiny_dist_config(), tiny_rng_config(data_parallel_random_init=True)
    )
    own = _checksum(provider.provide())
    engine.initialize_distributed(
        provider, tiny_dist_config(), tiny_rng_config(data_parallel_random_init=True)
    )
    wrapped = engine.setup_model(provider, data_parallel_random_init=True)
    return {"same_seed": same_seed, "own": own, "broadcast": _checksum(wrapped[0])}


def _two_ranks(rank: int, world: int) -> dict:
    out: dict[str, Any] = {
        "init": _data_parallel_init(),
        "dp2": _train(tp=1, mbs=2, gbs=4),
        "dp2_overlap": _train(
            tp=1,
            mbs=1,
            gbs=4,
            ddp=DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=3000),
        ),
        # dist.align_grad_reduce=false: DDP's backward hooks launch every bucket themselves.
        "dp2_overlap_unaligned": _train(
            tp=1,
            mbs=1,
            gbs=4,
            ddp=DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=3000),
            align_grad_reduce=False,
        ),
        "tp2": _train(tp=2, mbs=4, gbs=4),
    }
    group = dist.group.WORLD
    out["max_some_none"] = reduce_max_stat_across_model_parallel_group(
        None if rank == 0 else 3.0, group
    )
    out["max_all_none"] = reduce_max_stat_across_model_parallel_group(None, group)
    out["and_mixed"] = logical_and_across_model_parallel_group(rank == 0, group)
    out["and_true"] = logical_and_across_model_parallel_group(True, group)
    out["dtensor"] = _dtensor_norm()
    return out


@pytest.fixture(scope="module")
def single() -> dict:
    (result,) = run_distributed(_single_rank, 1, timeout=400)
    return result


@pytest.fixture(scope="module")
def two() -> list[dict]:
    return run_distributed(_two_ranks, 2, timeout=500)


def _close(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b) == ITERS
    assert a == pytest.approx(b, abs=TOL), (a, b)


@pytest.mark.multiprocess
@pytest.mark.timeout(450)
def test_grad_accumulation_equals_one_micro_batch_of_twice_the_size(single) -> None:
    _close(single["ga2"]["losses"], single["mb4"]["losses"])
    _close(single["ga2"]["grad_norms"], single["mb4"]["grad_norms"])
    assert all(single["mb4"]["ok"])
    assert all(math.isfinite(x) for x in single["mb4"]["losses"])
    # warm-up over one iteration, then cosine decay from 1e-3 towards 1e-4
    lrs = single["mb4"]["lrs"]
    assert lrs[0] == 0.0 and lrs[1] == pytest.approx(1e-3) and lrs[1] > lrs[-1] > 1e-4


@pytest.mark.multiprocess
@pytest.mark.timeout(550)
def test_data_parallel_and_tensor_parallel_match_one_process(single, two) -> None:
    reference = single["mb4"]
    for rank_result in two:
        for run in ("dp2", "dp2_overlap", "dp2_overlap_unaligned", "tp2"):
            _close(rank_result[run]["losses"], reference["losses"])
            _close(rank_result[run]["grad_norms"], reference["grad_norms"])
        assert rank_result["dp2_overlap"]["grad_sync_func"]
        assert not rank_result["dp2_overlap_unaligned"]["grad_sync_func"]
        assert not rank_result["dp2"]["grad_sync_func"]  # no overlap: nothing to launch
        # calc_params_l2_norm: TP shards summed, TP replicas counted once
        assert rank_result["tp2"]["params_norm"] == pytest.approx(
            reference["params_norm"], rel=1e-6
        )
        assert rank_result["dp2"]["params_norm"] == pytest.approx(
            reference["params_norm"], rel=1e-6
        )


@pytest.mark.multiprocess
@pytest.mark.timeout(450)
def test_optimizer_contract_against_torch(single) -> None:
    c = single["contract"]
    assert c["ok"] is True
    assert c["grad_norm"] == pytest.approx(c["expected_norm"], rel=1e-6)
    assert c["grad_norm"] > 0.05  # so clipping did something
    assert c["clipped_like_torch"] and c["updated"]
    assert c["num_zeros"] == c["expected_zeros"] > 0  # embedding rows of unseen tokens
    # megatron's rule: no weight decay on biases and 1-D parameters (norms)
    assert c["no_decay"] and all(n.endswith(".bias") or "layernorm" in n for n in c["no_decay"])
    assert c["decays"] == [0.0, 0.1]
    assert c["scheduler_lr"] == pytest.approx([1e-3] * len(c["scheduler_lr"]))


@pytest.mark.multiprocess
@pytest.mark.timeout(450)
def test_optimizer_state_round_trip_and_sharded_state(single) -> None:
    assert single["round_trip"] is True
    keys = single["sharded_keys"]
    assert any(k.startswith("optimizer.state.exp_avg.") for k in keys)
    assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in keys)
    # megatron stacks layers into one sharded tensor per parameter kind
    assert "optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight" in keys


@pytest.mark.multiprocess
@pytest.mark.timeout(450)
def test_overflow_and_nan_gradients_are_skipped_and_bf16_trains_with_fp32_main_params(
    single,
) -> None:
    fp16 = single["fp16"]
    assert fp16["skipped"] == (False, None, None)
    assert fp16["unchanged"] and fp16["scale_after_overflow"] == 128.0
    assert fp16["ok"] and fp16["moved"] and fp16["model_fp16"] and fp16["main_fp32"]
    assert fp16["model_is_main_in_fp16"]
    for precision in ("nan_fp32", "nan_bf16"):
        nan = single[precision]
        assert nan == {
            "ok": False,
            "grad_norm_is_nan": True,
            "unchanged": True,
            "clean_ok": True,
            "moved": True,
        }, (precision, nan)
    bf16 = single["bf16"]
    assert bf16["dtypes"] == ["torch.bfloat16"] and bf16["main_dtypes"] == ["torch.float32"]
    assert all(math.isfinite(x) for x in bf16["losses"]) and all(bf16["ok"])
    # bf16 follows the fp32 run closely over a few steps
    assert bf16["losses"] == pytest.approx(single["mb4"]["losses"], abs=0.05)


@pytest.mark.multiprocess
@pytest.mark.timeout(550)
def test_parameters_are_identical_on_data_parallel_ranks(two) -> None:
    r0, r1 = (r["init"] for r in two)
    assert r0["same_seed"] == r1["same_seed"]
    assert r0["own"] != r1["own"]  # data_parallel_random_init draws per rank ...
    assert r0["broadcast"] == r1["broadcast"] == r0["own"]  # ... then rank 0's are broadcast


@pytest.mark.multiprocess
@pytest.mark.timeout(550)
def test_cross_rank_reductions(two) -> None:
    for r in two:
        assert r["max_some_none"] == 3.0 and r["max_all_none"] is None
        assert r["and_mixed"] is False and r["and_true"] is True
        got, expected = r["dtensor"]
        assert got == pytest.approx(expected, rel=1e-6)


class _HostValueRequests(TorchFunctionMode):
    """Counts the tensor operations that hand a value to the host (a sync on a GPU)."""

    SYNCING = (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.cpu)

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.SYNCING:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_grad_norm_keeps_the_per_parameter_norms_on_the_device() -> None:
    """Without Transformer Engine or Apex, megatron's own fallback norm reads every
    parameter's norm on the host (56 synchronising calls per tiny-GPT iteration on the first
    GPU run); the engine gives grad clipping core-utils' norm, which reads none."""
    from megatron.core import utils as megatron_utils
    from megatron.core.optimizer import clip_grads

    from bridge.train.engine.megatron import use_sync_free_grad_norm
    from core_utils import local_multi_tensor_l2_norm

    original = clip_grads.l2_norm_impl
    try:
        use_sync_free_grad_norm()
        if original is megatron_utils.local_multi_tensor_l2_norm:
            assert clip_grads.l2_norm_impl is local_multi_tensor_l2_norm
        else:  # Transformer Engine's or Apex's kernel is installed and kept.
            assert clip_grads.l2_norm_impl is original
        grads = [torch.randn(7, 3), torch.randn(5), torch.randn(2, 2, 2)]
        counter = _HostValueRequests()
        with counter:
            norm, _ = clip_grads.multi_tensor_applier(
                clip_grads.l2_norm_impl, torch.zeros(1, dtype=torch.int), [grads], False
            )
        assert counter.count == 0
        expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
        torch.testing.assert_close(norm.reshape(()), expected, rtol=1e-6, atol=0)
    finally:
        clip_grads.l2_norm_impl = original
