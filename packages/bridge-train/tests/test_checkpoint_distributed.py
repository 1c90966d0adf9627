"""Checkpoints on real gloo ranks: round trips, resharding, exact resume, async, crashes.

Launches (each a fresh set of forked processes; module-scoped fixtures run each once):

* ``phase_a`` (2 ranks): TP=2 training, a synchronous save and two asynchronous ones
  (persistent worker and fork-per-save) while training continues, reloads into a
  differently initialised model; then DP=2 training saved at iteration K and continued to N.
* ``single_a`` (1 rank): the TP=2 checkpoint loaded at TP=1 (resharding) and saved again;
  single-process training saved at K and continued to N; non-persistent checkpoints; bad
  checkpoints (other model shape, no optimizer state, other schedule); finetuning.
* ``phase_b`` (2 ranks): the TP=1 checkpoint loaded back at TP=2; DP=2 resumed from K to N.
* ``crash_sync`` / ``crash_async`` (1 rank, killed): SIGKILL before the tracker is written,
  and during an asynchronous write.
* ``single_b`` (1 rank): single-process resume from K to N; the crashed directories load
  their previous checkpoint; the DP=2 checkpoint loads into one process.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import signal
from logging.handlers import BufferingHandler
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bridge.config import CheckpointConfig, ConfigContainer, LoggerConfig
from bridge.train import GlobalState
from bridge.train.checkpointing import (
    CheckpointError,
    checkpoint_dir_name,
    finalize_async_saves,
    init_checkpointing_context,
    load_checkpoint,
    pending_async_saves,
    save_checkpoint,
)
from bridge.train.engine import MegatronEngine
from bridge.train.engine.initialize import resume_seed, seed_process_generators
from bridge.train.loop.bare_loop import train_steps
from bridge.train.testing import (
    tiny_dist_config,
    tiny_gpt_provider,
    tiny_mock_dataset_config,
    tiny_mock_iterator,
    tiny_optimizer_config,
    tiny_rng_config,
    tiny_scheduler_config,
    tiny_train_config,
)
from core_utils.testing import DistributedTestError, run_distributed

pytestmark = [pytest.mark.multiprocess]

K, N = 2, 4  # save after K iterations, train to N
GBS, MBS = 4, 2
FLOPS = 1.25e9


# ---------------------------------------------------------------------------- helpers


def _config(
    tp: int = 1, seed: int = 1234, bf16: bool = False, **checkpoint: Any
) -> ConfigContainer:
    model_dtype = {"bf16": True, "params_dtype": torch.bfloat16} if bf16 else {}
    return ConfigContainer(
        model=tiny_gpt_provider(tensor_model_parallel_size=tp, **model_dtype),
        optimizer=tiny_optimizer_config(bf16=bf16),
        scheduler=tiny_scheduler_config(),
        train=tiny_train_config(train_iters=N, global_batch_size=GBS, micro_batch_size=MBS),
        checkpoint=CheckpointConfig(**checkpoint),
        logger=LoggerConfig(),
        dataset=tiny_mock_dataset_config(),
        rng=tiny_rng_config(seed=seed),
    )


class _Run:
    """Model, optimizer, scheduler and state built from a config, as the trainer does."""

    def __init__(self, cfg: ConfigContainer) -> None:
        assert cfg.model is not None and cfg.optimizer is not None and cfg.scheduler is not None
        self.engine = MegatronEngine()
        self.engine.initialize_distributed(cfg.model, tiny_dist_config(), cfg.rng)
        self.model = self.engine.setup_model(cfg.model)
        self.optimizer, self.scheduler = self.engine.setup_optimizer(
            self.model, cfg.optimizer, cfg.scheduler, cfg.train
        )
        self.state = GlobalState(cfg=cfg)
        assert cfg.checkpoint is not None
        self.context = init_checkpointing_context(cfg.checkpoint)
        self._iterator: Any = None

    def train(self, iters: int) -> list[float]:
        if self._iterator is None:  # positioned at the consumed samples (resume)
            assert self.state.cfg.train is not None
            self._iterator = tiny_mock_iterator(
                self.state.cfg.train, train_state=self.state.train_state
            )
        result = train_steps(
            self.engine,
            self.model,
            self.optimizer,
            self.scheduler,
            self._iterator,
            train_iters=iters,
            global_batch_size=GBS,
            micro_batch_size=MBS,
            seq_length=16,
            train_state=self.state.train_state,
        )
        return result.losses

    def save(self, **kwargs: Any) -> None:
        save_checkpoint(
            self.state, self.model, self.optimizer, self.scheduler, FLOPS, self.context, **kwargs
        )

    def load(self, **kwargs: Any) -> tuple[int, float]:
        return load_checkpoint(self.state, self.model, self.optimizer, self.scheduler, **kwargs)

    def use(self, **checkpoint: Any) -> None:
        """Switch the checkpoint settings (a new context, as a new run would have)."""
        current = self.state.cfg.checkpoint
        assert current is not None
        self.state.cfg.checkpoint = dataclasses.replace(current, **checkpoint)
        self.context = init_checkpointing_context(self.state.cfg.checkpoint)

    def snapshot(self) -> dict[str, Any]:
        """Parameters (with their tensor-parallel split axis) and Adam state, by name."""
        params = {
            name: (
                p.detach().clone(),
                # megatron sets partition_dim on tensor-parallel parameters (torch does not declare it)
                p.partition_dim  # type: ignore[attr-defined]
                if getattr(p, "tensor_model_parallel", False)
                else None,
            )
            for name, p in self.model[0].named_parameters()
        }
        names = {id(p): n for n, p in self.model[0].named_parameters()}
        optim = {}
        for inner, model_param, main in _optimized_params(self.optimizer):
            state = inner.optimizer.state.get(main, {})
            optim[names[id(model_param)]] = {k: v.detach().clone() for k, v in state.items()}
        return {
            "params": params,
            "optim": optim,
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "scheduler_steps": int(self.scheduler.num_steps),
            "step": self.state.train_state.step,
        }


def _optimized_params(optimizer: Any) -> list[tuple[Any, torch.nn.Parameter, torch.Tensor]]:
    """``(inner optimizer, model parameter, the parameter it steps)`` for megatron's
    optimizer: the model parameter itself in fp32, its fp32 main copy in bf16/fp16."""
    out = []
    for inner in optimizer.chained_optimizers:
        if hasattr(inner, "float16_groups"):  # mixed precision: fp32 main copies
            pairs = [
                pair
                for model_group, main_group in zip(
                    inner.float16_groups, inner.fp32_from_float16_groups, strict=True
                )
                for pair in zip(model_group, main_group, strict=True)
            ]
            pairs += [(p, p) for group in inner.fp32_from_fp32_groups for p in group]
        else:
            pairs = [(p, p) for group in inner.optimizer.param_groups for p in group["params"]]
        out += [(inner, model_param, main) for model_param, main in pairs]
    return out


def _equal_local(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Names whose parameter or optimizer state differs (bitwise) between two snapshots."""
    bad = [n for n in a["params"] if not torch.equal(a["params"][n][0], b["params"][n][0])]
    for name, state in a["optim"].items():
        for key, value in state.items():
            other = b["optim"].get(name, {}).get(key)
            if other is None or not torch.equal(value, other):
                bad.append(f"{name}.{key}")
    return bad


def _full(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Join tensor-parallel snapshots (one per rank) into TP=1 tensors."""
    params = {}
    for name, (first, dim) in shards[0]["params"].items():
        parts = [s["params"][name][0] for s in shards]
        params[name] = (first if dim is None else torch.cat(parts, dim), None)
    optim = {}
    for name, state in shards[0]["optim"].items():
        dim = shards[0]["params"][name][1]
        optim[name] = {
            key: value
            if dim is None or value.dim() == 0
            else torch.cat([s["optim"][name][key] for s in shards], dim)
            for key, value in state.items()
        }
    return {"params": params, "optim": optim}


def _shard(full: dict[str, Any], rank: int, world: int, layout: dict[str, Any]) -> dict[str, Any]:
    """The rank's tensor-parallel part of TP=1 tensors (``layout`` gives split axes)."""

    def part(value: torch.Tensor, dim: int | None) -> torch.Tensor:
        if dim is None or value.dim() == 0:
            return value
        return value.chunk(world, dim)[rank]

    params = {n: (part(v, layout["params"][n][1]), None) for n, (v, _) in full["params"].items()}
    optim = {
        n: {k: part(v, layout["params"][n][1]) for k, v in state.items()}
        for n, state in full["optim"].items()
    }
    return {"params": params, "optim": optim}


def _rng_draws() -> tuple[list[float], float, list[float]]:
    return torch.rand(3).tolist(), random.random(), np.random.rand(2).tolist()


def _reseed_differently() -> None:
    torch.manual_seed(999)
    random.seed(999)
    np.random.seed(999)


# ---------------------------------------------------------------------------- launches


def _phase_a(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    import psutil
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    # --- tensor parallel: sync save, two async saves while training continues
    run = _Run(_config(tp=2, save=f"{root}/tp2"))
    queue = filesystem_async._results_queue
    manager = queue._manager._process
    out["results_queue_from_fork"] = type(manager).__name__
    out["results_queue_manager_pid"] = manager.pid
    out["results_queue_manager_is_my_child"] = psutil.Process(manager.pid).ppid() == os.getpid()
    run.train(K)
    saved_k = run.snapshot()
    run.save()
    out["tp2_saved"] = saved_k
    async_dirs = {}
    for name, persistent in (("tp2_async_persistent", True), ("tp2_async_fork", False)):
        directory = f"{root}/{name}"
        run.use(save=directory, async_save=True, use_persistent_ckpt_worker=persistent)
        before = run.snapshot()
        out[f"{name}_iteration"] = run.state.train_state.step
        run.save()
        out[f"{name}_pending"] = pending_async_saves()
        out[f"{name}_listing_before"] = sorted(os.listdir(directory))
        out[f"{name}_losses_meanwhile"] = run.train(1)  # changes every parameter in place
        out[f"{name}_changed_meanwhile"] = bool(_equal_local(before, run.snapshot()))
        finalize_async_saves(run.state.fault_tolerance, blocking=True)
        out[f"{name}_listing_after"] = sorted(os.listdir(directory))
        async_dirs[name] = (directory, before)
    finalize_async_saves(run.state.fault_tolerance, blocking=True, terminate=True)

    # Reload every checkpoint into a model initialised from another seed.
    fresh = _Run(_config(tp=2, seed=4321, load=f"{root}/tp2"))
    out["fresh_differs"] = bool(_equal_local(saved_k, fresh.snapshot()))
    out["tp2_loaded_return"] = fresh.load()
    out["tp2_reload_mismatch"] = _equal_local(saved_k, fresh.snapshot())
    out["tp2_reload_train_state"] = dataclasses.asdict(fresh.state.train_state)
    out["tp2_reload_lr"] = fresh.snapshot()["lr"], saved_k["lr"]
    for name, (directory, expected) in async_dirs.items():
        fresh.use(load=directory)
        out[f"{name}_loaded_return"] = fresh.load()
        out[f"{name}_mismatch"] = _equal_local(expected, fresh.snapshot())

    # --- data parallel (replicated) save at K, continued to N
    dp = _Run(_config(tp=1, save=f"{root}/dp2"))
    dp.train(K)
    out["dp2_saved"] = dp.snapshot()
    dp.save()
    out["dp2_losses_after_k"] = dp.train(N - K)
    out["dp2_final"] = dp.snapshot()
    return out


def _single_a(rank: int, world: int, root: str, tp2_full: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # --- TP=2 checkpoint into one process (resharding), then saved at TP=1
    run = _Run(_config(tp=1, seed=4321, load=f"{root}/tp2", save=f"{root}/tp1_from_tp2"))
    out["resharded_return"] = run.load()
    out["resharded_mismatch"] = _equal_local(tp2_full, run.snapshot())
    run.save()

    # --- single-process exact resume, first half
    single = _Run(_config(save=f"{root}/single"))
    single.train(K)
    single.save()
    single_saved = single.snapshot()
    out["single_rng_after_save"] = _rng_draws()
    out["single_losses_after_k"] = single.train(N - K)
    out["single_final"] = single.snapshot()

    # --- bad checkpoints
    other_shape = _Run(
        dataclasses.replace(_config(load=f"{root}/single"), model=tiny_gpt_provider(hidden_size=64))
    )
    with pytest.raises(CheckpointError) as shape:
        other_shape.load()
    out["shape_error"] = str(shape.value)

    no_optim = _Run(_config(save=f"{root}/no_optim", save_optim=False, save_rng=False))
    no_optim.train(1)
    no_optim.save()
    no_optim.use(load=f"{root}/no_optim")
    with pytest.raises(CheckpointError) as missing_optim:
        no_optim.load()
    out["no_optim_error"] = str(missing_optim.value)
    no_optim.use(load_optim=False, load_rng=False)
    out["no_optim_load_model_only"] = no_optim.load()

    other_lr = dataclasses.replace(
        _config(load=f"{root}/single"), optimizer=tiny_optimizer_config(lr=5e-3)
    )
    schedule = _Run(other_lr)
    with pytest.raises(CheckpointError) as lr_error:
        schedule.load()
    out["schedule_error"] = str(lr_error.value)
    other_lr.scheduler = tiny_scheduler_config(override_opt_param_scheduler=True)
    overridden = _Run(other_lr)
    overridden.scheduler.step(7 * GBS)  # already stepped: loading must not add to it
    overridden.load()
    out["override_lr"] = overridden.snapshot()["lr"], overridden.scheduler.max_lr
    out["override_steps"] = overridden.scheduler.num_steps
    other_lr.scheduler = tiny_scheduler_config(use_checkpoint_opt_param_scheduler=True)
    from_checkpoint = _Run(other_lr)
    from_checkpoint.load()
    out["checkpoint_lr"] = (
        from_checkpoint.snapshot()["lr"],
        from_checkpoint.scheduler.max_lr,
        sorted({g["max_lr"] for g in from_checkpoint.optimizer.param_groups}),
    )

    # --- finetuning from a pretrained checkpoint: model only, iteration 0
    finetune = _Run(_config(seed=4321, pretrained_checkpoint=f"{root}/single", finetune=True))
    out["finetune_return"] = finetune.load()
    snapshot = finetune.snapshot()
    out["finetune_params_mismatch"] = [
        n
        for n, (v, _) in single_saved["params"].items()
        if not torch.equal(v, snapshot["params"][n][0])
    ]
    out["finetune_optimizer_state"] = sum(len(s) for s in snapshot["optim"].values())
    out["finetune_train_state"] = dataclasses.asdict(finetune.state.train_state)

    # --- bf16: fp32 main parameters from the checkpoint without its optimizer state
    mixed = _Run(_config(bf16=True, save=f"{root}/bf16"))
    mixed.train(K)
    mixed.save()
    saved_main = [p.detach().clone() for p in mixed.optimizer.get_parameters()]
    for flag in (True, False):
        restored = _Run(
            _config(
                bf16=True,
                seed=4321,
                load=f"{root}/bf16",
                load_optim=False,
                load_main_params_from_ckpt=flag,
            )
        )
        restored.load()
        main = list(restored.optimizer.get_parameters())
        out[f"main_params_exact_{flag}"] = all(
            torch.equal(a, b) for a, b in zip(saved_main, main, strict=True)
        )
        out[f"main_params_dtype_{flag}"] = sorted({str(p.dtype) for p in main})
        out[f"main_params_optimizer_state_{flag}"] = sum(
            len(inner.optimizer.state) for inner in restored.optimizer.chained_optimizers
        )

    # --- cached save plans (constant structure): the third save reuses the cached plan
    cached = _Run(
        _config(save=f"{root}/cached", async_save=True, ckpt_assume_constant_structure=True)
    )
    for _ in range(3):
        cached.train(1)
        cached.save()
        finalize_async_saves(cached.state.fault_tolerance, blocking=True)
    out["cached_plan_reused"] = bool(cached.context["save_strategy"].validated_cache_reuse)
    cached_expected = cached.snapshot()
    finalize_async_saves(cached.state.fault_tolerance, blocking=True, terminate=True)
    reload = _Run(_config(seed=4321, load=f"{root}/cached"))
    out["cached_return"] = reload.load()
    out["cached_mismatch"] = _equal_local(cached_expected, reload.snapshot())

    # --- non-persistent checkpoints
    import bridge.train.checkpointing.save as save_module

    np_run = _Run(
        _config(save=f"{root}/np_run", load=f"{root}/np_run", non_persistent_ckpt_type="global")
    )
    np_dir = Path(root) / "np_run" / "non_persistent"
    seen_at_commit: list[tuple[str, list[str]]] = []
    original = save_module.write_tracker

    def recording_tracker(root: str | os.PathLike[str], iteration: int) -> None:
        seen_at_commit.append((str(root), sorted(os.listdir(root))))
        original(root, iteration)

    save_module.write_tracker = recording_tracker
    try:
        np_run.train(1)
        np_run.save()  # persistent, iteration 1
        for _ in range(2):
            np_run.train(1)
            np_run.save(non_persistent_ckpt=True)  # iterations 2, 3
    finally:
        save_module.write_tracker = original
    out["np_seen_at_commit"] = seen_at_commit
    out["np_listing"] = sorted(os.listdir(np_dir))
    out["np_loaded_newest"] = np_run.load()
    np_run.train(1)
    np_run.save()  # persistent, iteration 4: newer than the non-persistent one
    out["np_loaded_persistent"] = np_run.load()
    return out


def _phase_b(rank: int, world: int, root: str, tp2_local: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    back = _Run(_config(tp=2, seed=4321, load=f"{root}/tp1_from_tp2"))
    out["back_return"] = back.load()
    out["back_mismatch"] = _equal_local(tp2_local[rank], back.snapshot())

    dp = _Run(_config(tp=1, seed=4321, load=f"{root}/dp2"))
    out["dp2_return"] = dp.load()
    out["dp2_losses_after_k"] = dp.train(N - K)
    out["dp2_final"] = dp.snapshot()
    return out


def _crash_before_tracker(rank: int, world: int, root: str) -> None:
    import bridge.train.checkpointing.save as save_module

    run = _Run(_config(save=f"{root}/crash_sync"))
    run.train(K)
    run.save()
    torch.save(run.snapshot(), Path(root) / "crash_sync_expected.pt")
    run.train(K)

    # every shard, the marker and the rename are done
    def die(root: str | os.PathLike[str], iteration: int) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    save_module.write_tracker = die
    run.save()


def _crash_during_async_write(rank: int, world: int, root: str) -> None:
    run = _Run(_config(save=f"{root}/crash_async", async_save=True))
    run.train(K)
    run.save()
    finalize_async_saves(run.state.fault_tolerance, blocking=True)
    torch.save(run.snapshot(), Path(root) / "crash_async_expected.pt")
    run.train(K)
    run.save()  # scheduled; the writer runs in the background
    os.kill(os.getpid(), signal.SIGKILL)


def _single_b(rank: int, world: int, root: str, dp2_saved: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _reseed_differently()
    single = _Run(_config(seed=4321, load=f"{root}/single"))
    _reseed_differently()  # the load must bring back the saved generators
    out["single_return"] = single.load()
    out["single_rng_after_load"] = _rng_draws()
    out["single_losses_after_k"] = single.train(N - K)
    out["single_final"] = single.snapshot()

    for name in ("crash_sync", "crash_async"):
        run = _Run(_config(seed=4321, load=f"{root}/{name}", save=f"{root}/{name}"))
        out[f"{name}_return"] = run.load()
        expected = torch.load(Path(root) / f"{name}_expected.pt")
        out[f"{name}_mismatch"] = _equal_local(expected, run.snapshot())
        run.train(1)
        run.save()  # the next save clears what the crash left behind
        finalize_async_saves(run.state.fault_tolerance, blocking=True, terminate=True)
        out[f"{name}_listing_after_next_save"] = sorted(os.listdir(Path(root) / name))

    dp_into_one = _Run(_config(seed=4321, load=f"{root}/dp2"))
    warnings = BufferingHandler(capacity=1000)
    warnings.setLevel(logging.WARNING)
    logging.getLogger("bridge.train").addHandler(warnings)
    reseeded: list[int] = []

    def reseed(iteration: int) -> int:  # as the loaders do after a layout change
        reseeded.append(iteration)
        seed_process_generators(resume_seed(4321, iteration))
        return 4321

    out["dp2_into_one_return"] = dp_into_one.load(reseed=reseed)
    out["dp2_into_one_reseeded"] = (reseeded, _rng_draws())
    logging.getLogger("bridge.train").removeHandler(warnings)
    out["dp2_into_one_warnings"] = [record.getMessage() for record in warnings.buffer]
    out["dp2_into_one_mismatch"] = _equal_local(dp2_saved, dp_into_one.snapshot())
    return out


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="module")
def phase_a(root: str) -> list[dict[str, Any]]:
    return run_distributed(_phase_a, 2, root, timeout=280)


@pytest.fixture(scope="module")
def single_a(root: str, phase_a: list[dict[str, Any]]) -> dict[str, Any]:
    tp2_full = _full([r["tp2_saved"] for r in phase_a])
    (result,) = run_distributed(_single_a, 1, root, tp2_full, timeout=280)
    return result


@pytest.fixture(scope="module")
def phase_b(
    root: str, phase_a: list[dict[str, Any]], single_a: dict[str, Any]
) -> list[dict[str, Any]]:
    return run_distributed(_phase_b, 2, root, [r["tp2_saved"] for r in phase_a], timeout=280)


@pytest.fixture(scope="module")
def crashes(root: str) -> dict[str, str]:
    messages = {}
    for name, fn in (
        ("crash_sync", _crash_before_tracker),
        ("crash_async", _crash_during_async_write),
    ):
        with pytest.raises(DistributedTestError) as info:
            run_distributed(fn, 1, root, timeout=200)
        messages[name] = str(info.value)
    return messages


@pytest.fixture(scope="module")
def single_b(
    root: str, phase_a: list[dict[str, Any]], single_a: dict[str, Any], crashes: dict[str, str]
) -> dict[str, Any]:
    (result,) = run_distributed(_single_b, 1, root, phase_a[0]["dp2_saved"], timeout=280)
    return result


# ---------------------------------------------------------------------------- tests


@pytest.mark.timeout(300)
def test_results_queue_is_forked_per_rank(phase_a: list[dict[str, Any]]) -> None:
    """dist_checkpointing's write-results queue comes from a Manager forked by each rank
    (not a spawned interpreter that re-imports everything)."""
    for out in phase_a:
        assert out["results_queue_from_fork"] == "ForkProcess"
        assert out["results_queue_manager_is_my_child"]
    assert len({out["results_queue_manager_pid"] for out in phase_a}) == 2


@pytest.mark.timeout(300)
def test_tensor_parallel_round_trip(phase_a: list[dict[str, Any]]) -> None:
    for out in phase_a:
        assert out["fresh_differs"]  # the reload target really started elsewhere
        assert out["tp2_loaded_return"] == (K, FLOPS)
        assert out["tp2_reload_mismatch"] == []
        assert out["tp2_reload_train_state"]["step"] == K
        assert out["tp2_reload_train_state"]["consumed_train_samples"] == K * GBS
        assert out["tp2_reload_train_state"]["floating_point_operations_so_far"] == FLOPS
        lr_loaded, lr_saved = out["tp2_reload_lr"]
        assert lr_loaded == lr_saved
    # The optimizer state is there and sharded like the parameters.
    shards = [out["tp2_saved"] for out in phase_a]
    name = next(n for n, (_, dim) in shards[0]["params"].items() if dim is not None)
    assert set(shards[0]["optim"][name]) >= {"exp_avg", "exp_avg_sq", "step"}
    assert not torch.equal(shards[0]["optim"][name]["exp_avg"], shards[1]["optim"][name]["exp_avg"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["tp2_async_persistent", "tp2_async_fork"])
def test_async_save_lets_training_continue_and_matches(
    phase_a: list[dict[str, Any]], name: str
) -> None:
    for out in phase_a:
        iteration = out[f"{name}_iteration"]
        assert out[f"{name}_pending"] == 1
        # Until finalized, nothing counts: no checkpoint directory, no tracker.
        # (checkpoint.lock is the run's lock on the directory, taken at setup.)
        assert out[f"{name}_listing_before"] == ["checkpoint.lock", f"iter_{iteration:07d}.tmp"]
        assert len(out[f"{name}_losses_meanwhile"]) == 1
        assert out[f"{name}_changed_meanwhile"]  # training moved the weights meanwhile
        assert out[f"{name}_listing_after"] == [
            "checkpoint.lock",
            f"iter_{iteration:07d}",
            "latest_checkpointed_iteration.txt",
        ]
        # What was written is the state at the save, not the state after training on.
        assert out[f"{name}_loaded_return"] == (iteration, FLOPS)
        assert out[f"{name}_mismatch"] == []


@pytest.mark.timeout(300)
def test_tensor_parallel_checkpoint_reshards_to_one_rank_and_back(
    phase_a: list[dict[str, Any]], single_a: dict[str, Any], phase_b: list[dict[str, Any]]
) -> None:
    assert single_a["resharded_return"] == (K, FLOPS)
    assert single_a["resharded_mismatch"] == []
    for out in phase_b:
        assert out["back_return"] == (K, FLOPS)
        assert out["back_mismatch"] == []


@pytest.mark.timeout(300)
def test_data_parallel_resume_is_exact(
    phase_a: list[dict[str, Any]], phase_b: list[dict[str, Any]]
) -> None:
    for before, after in zip(phase_a, phase_b, strict=True):
        assert after["dp2_return"] == (K, FLOPS)
        assert after["dp2_losses_after_k"] == before["dp2_losses_after_k"]
        assert _equal_local(before["dp2_final"], after["dp2_final"]) == []
        assert after["dp2_final"]["scheduler_steps"] == before["dp2_final"]["scheduler_steps"]


@pytest.mark.timeout(300)
def test_single_process_resume_is_exact(single_a: dict[str, Any], single_b: dict[str, Any]) -> None:
    assert single_b["single_return"] == (K, FLOPS)
    assert single_b["single_rng_after_load"] == single_a["single_rng_after_save"]
    assert single_b["single_losses_after_k"] == single_a["single_losses_after_k"]
    assert _equal_local(single_a["single_final"], single_b["single_final"]) == []
    assert single_b["single_final"]["lr"] == single_a["single_final"]["lr"]


@pytest.mark.timeout(300)
def test_data_parallel_checkpoint_loads_into_one_process(
    root: str, phase_a: list[dict[str, Any]], single_b: dict[str, Any]
) -> None:
    assert single_b["dp2_into_one_return"] == (K, FLOPS)
    assert single_b["dp2_into_one_mismatch"] == []
    # The load reseeded from (seed, iteration) once, where the saved generators were skipped.
    seed_process_generators(resume_seed(4321, K))
    assert single_b["dp2_into_one_reseeded"] == ([K], _rng_draws())
    # One line for the one event: both layouts, and what happens to the generators.
    (rng_warning,) = [m for m in single_b["dp2_into_one_warnings"] if "RNG" in m]
    assert rng_warning == (
        f"resuming iteration {K} of {Path(root) / 'dp2' / checkpoint_dir_name(K)} under another parallel layout "
        "(TP1 PP1 CP1 DP2 EP1 ETP1 -> TP1 PP1 CP1 DP1 EP1 ETP1): its RNG states are per rank "
        f"and not restored; the generators are reseeded from rng.seed=4321 and iteration {K} "
        f"(base seed {resume_seed(4321, K)}; dropout masks depend on the layout)"
    )


@pytest.mark.timeout(300)
def test_crash_before_the_tracker_keeps_the_previous_checkpoint(
    root: str, crashes: dict[str, str], single_b: dict[str, Any]
) -> None:
    assert "exited without a result" in crashes["crash_sync"]
    assert single_b["crash_sync_return"] == (K, FLOPS)
    assert single_b["crash_sync_mismatch"] == []
    # The resumed run saved iteration K+1 and the uncommitted K+K directory is untouched
    # history (complete, never counted); the tracker moved to K+1.
    listing = single_b["crash_sync_listing_after_next_save"]
    assert f"iter_{K + 1:07d}" in listing and f"iter_{K:07d}" in listing
    assert (
        Path(root) / "crash_sync" / "latest_checkpointed_iteration.txt"
    ).read_text() == f"{K + 1}\n"


@pytest.mark.timeout(300)
def test_crash_during_an_async_write_keeps_the_previous_checkpoint(
    root: str, crashes: dict[str, str], single_b: dict[str, Any]
) -> None:
    assert "exited without a result" in crashes["crash_async"]
    assert single_b["crash_async_return"] == (K, FLOPS)
    assert single_b["crash_async_mismatch"] == []
    listing = single_b["crash_async_listing_after_next_save"]
    # The half-written directory of the crashed save is gone after the next save.
    assert not any(name.endswith(".tmp") for name in listing)
    assert f"iter_{K + 1:07d}" in listing


@pytest.mark.timeout(300)
def test_checkpoint_of_another_model_shape_names_the_key(single_a: dict[str, Any]) -> None:
    message = single_a["shape_error"]
    assert "was saved from a model of a different shape" in message
    # Model tensors are named first, each once.
    assert "embedding.word_embeddings.weight (checkpoint (128, 32), model (128, 64))" in message
    assert "embedding.position_embeddings.weight (checkpoint (16, 32), model (16, 64))" in message
    assert message.count("position_embeddings") == 1


@pytest.mark.timeout(300)
def test_state_that_was_not_saved_is_not_silently_skipped(single_a: dict[str, Any]) -> None:
    assert (
        "saved without optimizer state (checkpoint.save_optim=False)" in single_a["no_optim_error"]
    )
    assert "set checkpoint.load_optim=False" in single_a["no_optim_error"]
    assert single_a["no_optim_load_model_only"] == (1, FLOPS)


@pytest.mark.timeout(300)
def test_scheduler_settings_are_checked_and_never_double_counted(single_a: dict[str, Any]) -> None:
    message = single_a["schedule_error"]
    assert "max_lr (config 0.005, checkpoint 0.001)" in message
    assert "scheduler.override_opt_param_scheduler=True" in message
    lr, max_lr = single_a["override_lr"]
    assert max_lr == 5e-3  # the config's value was kept
    assert 1e-3 < lr < 5e-3  # the config's schedule (the checkpoint's peaks at 1e-3)
    # Loading restored the saved step count instead of adding it to the 7 steps taken.
    assert single_a["override_steps"] == K * GBS
    # use_checkpoint_opt_param_scheduler: the checkpoint's schedule, in every parameter group.
    lr, max_lr, group_max_lrs = single_a["checkpoint_lr"]
    assert max_lr == 1e-3 and group_max_lrs == [1e-3] and 0.0 < lr <= 1e-3


@pytest.mark.timeout(300)
def test_finetuning_loads_the_model_only(single_a: dict[str, Any]) -> None:
    assert single_a["finetune_return"] == (0, 0.0)
    assert single_a["finetune_params_mismatch"] == []
    assert single_a["finetune_optimizer_state"] == 0
    state = single_a["finetune_train_state"]
    assert state["step"] == 0 and state["consumed_train_samples"] == 0


@pytest.mark.timeout(300)
def test_non_persistent_checkpoints(single_a: dict[str, Any]) -> None:
    commits = single_a["np_seen_at_commit"]
    persistent_root, persistent_listing = commits[0]
    assert persistent_root.endswith("np_run") and "iter_0000001" in persistent_listing
    # When iteration 3 was committed, iteration 2 was still there: removed only afterwards.
    np_root, listing_at_3 = commits[2]
    assert np_root.endswith("non_persistent")
    assert "iter_0000002" in listing_at_3 and "iter_0000003" in listing_at_3
    assert single_a["np_listing"] == ["iter_0000003", "latest_checkpointed_iteration.txt"]
    assert single_a["np_loaded_newest"] == (3, FLOPS)
    assert single_a["np_loaded_persistent"] == (4, FLOPS)


@pytest.mark.timeout(300)
def test_fp32_main_parameters_come_from_the_checkpoint_on_request(single_a: dict[str, Any]) -> None:
    assert single_a["main_params_dtype_True"] == ["torch.float32"]
    # With load_main_params_from_ckpt the fp32 copies are the saved ones, bit for bit ...
    assert single_a["main_params_exact_True"]
    # ... without it they are the bf16 model weights widened, which lose precision.
    assert not single_a["main_params_exact_False"]
    assert single_a["main_params_optimizer_state_True"] == 0  # load_optim=False


@pytest.mark.timeout(300)
def test_checkpoint_directory_holds_its_config_and_marker(
    root: str, phase_a: list[dict[str, Any]]
) -> None:
    import json

    directory = Path(root) / "tp2" / f"iter_{K:07d}"
    marker = json.loads((directory / "checkpoint_complete.json").read_text())
    assert marker["iteration"] == K and marker["format"] == "torch_dist"
    assert marker["parallel_layout"]["tensor_model_parallel_size"] == 2
    assert marker["optimizer"] and marker["rng"] and not marker["non_persistent"]
    config = ConfigContainer.from_yaml(directory / "run_config.yaml")
    assert config.model is not None and config.checkpoint is not None
    assert config.model.tensor_model_parallel_size == 2
    assert config.checkpoint.save == f"{root}/tp2"
    assert (directory / "metadata.json").exists() and (directory / ".metadata").exists()


@pytest.mark.timeout(300)
def test_saves_with_cached_plans_load_back(single_a: dict[str, Any]) -> None:
    assert single_a["cached_plan_reused"]
    assert single_a["cached_return"] == (3, FLOPS)
    assert single_a["cached_mismatch"] == []
