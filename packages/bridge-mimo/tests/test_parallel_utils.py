"""The reference utilities of bridge.mimo, on real grids and groups (gloo)."""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from megatron.core.hyper_comm_grid import HyperCommGrid

import bridge.mimo as mimo
from core_utils.testing import run_distributed

FAN_IN = {
    "vision": {"ranks": range(0, 2), "dp": 2},
    "language": {"ranks": range(2, 4), "tp": 2},
}


def _grid(shape: list[int], offset: int = 0) -> HyperCommGrid:
    return HyperCommGrid(shape, ["tp", "cp", "dp", "pp"], rank_offset=offset)


def test_dp_size_comes_from_grid_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert mimo._get_dp_size_from_grid(_grid([2, 1, 3, 1])) == 3
    with pytest.raises(ValueError, match="grid has no 'dp' dimension"):
        mimo._get_dp_size_from_grid(HyperCommGrid([2], ["tp"]))


def test_stub_ranks_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    grids = {"vision": _grid([1, 1, 2, 1]), "language": _grid([1, 1, 1, 1], offset=3)}
    with pytest.raises(
        ValueError, match=r"rank 2 does not participate in any module \(stub ranks \[2\]"
    ):
        mimo.validate_no_stub_ranks(grids, world_size=4)
    mimo.validate_no_stub_ranks(grids, world_size=2)


def test_finalize_with_no_local_module_does_nothing() -> None:
    # Reference 003: gradients are finalized for each module of this rank; with none there
    # is nothing to do (no process group is needed: the infra names no module at all).
    infra = SimpleNamespace(module_to_grid_map={}, pg_collections={})
    assert mimo.finalize_model_grads_multimodule([], infra=infra, module_to_grid_tuple=[]) is None
    assert (
        mimo.finalize_model_grads_multimodule(
            [], torch.tensor(3), None, True, infra=infra, module_to_grid_tuple=[]
        )
        is None
    )


def _grid_only_infra(layout: mimo.MimoLayout) -> mimo.MegatronMIMOInfra:
    grids = {
        name: HyperCommGrid(p.grid_shape, p.grid_dim_names, rank_offset=p.rank_offset)
        for name, p in layout.modules.items()
    }
    return mimo.MegatronMIMOInfra(
        module_to_grid_map=grids,
        topology={},
        pg_collections=dict.fromkeys(grids),
        participating_modules=[],
        language_module_name="language",
        layout=layout,
    )


def test_data_loader_contract_names_module_and_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "6")
    infra = _grid_only_infra(
        mimo.MimoLayout(
            {
                "vision": mimo.ModulePlacement(ranks=range(0, 4), dp=4),
                "language": mimo.ModulePlacement(ranks=range(4, 6), dp=2),
            }
        )
    )
    mimo.validate_data_loader_contract(infra, 16, 8, 2)
    with pytest.raises(
        ValueError,
        match="micro_batch_size=6 is not divisible by module 'vision''s data-parallel size 4",
    ):
        mimo.validate_data_loader_contract(infra, 12, 6, 2)
    with pytest.raises(
        ValueError,
        match="global_batch_size=18 is not divisible by module 'vision''s data-parallel size 4",
    ):
        mimo.validate_data_loader_contract(infra, 18, 4, 4)
    with pytest.raises(
        ValueError,
        match=r"num_microbatches \* micro_batch_size = 3 \* 4 = 12 != global_batch_size=16",
    ):
        mimo.validate_data_loader_contract(infra, 16, 4, 3)
    with pytest.raises(ValueError, match="num_microbatches must be a positive integer, got 0"):
        mimo.validate_data_loader_contract(infra, 16, 4, 0)


class _BufferedModule(torch.nn.Module):
    """Stands for a megatron-DDP-wrapped module: owns a gradient buffer it resets itself."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.resets = 0

    def zero_grad_buffer(self) -> None:
        self.resets += 1


def _utilities_on_ranks(rank: int, world_size: int, harness: SimpleNamespace) -> dict[str, Any]:
    from megatron.core.process_groups_config import MultiModuleProcessGroupCollection
    from megatron.core.transformer.module import Float16Module

    infra = mimo.build_megatron_mimo_infra(harness.make_layout(FAN_IN))
    out: dict[str, Any] = {"participating": infra.participating_modules}
    grids = infra.module_to_grid_map
    out["in_grid"] = {n: mimo.is_current_rank_in_grid(g) for n, g in grids.items()}
    out["dp_sizes"] = {n: mimo._get_dp_size_from_grid(g) for n, g in grids.items()}
    name, pgs = mimo.get_active_module_pg(infra)
    out["active"] = (name, pgs.tp.size(), pgs.dp.size(), dist.get_process_group_ranks(pgs.dp))
    schedule_pgs = mimo.build_pg_collection_for_schedule(infra)
    assert isinstance(schedule_pgs, MultiModuleProcessGroupCollection)
    out["schedule"] = (list(schedule_pgs.keys()), schedule_pgs.has_language_model())
    assert schedule_pgs[name] is pgs  # the infra's groups, not rebuilt

    # Model wrappers and module lookup.
    model = mimo.build_mimo_model(infra, init_seed=1, **mimo.tiny_vlm_specs(harness.CONFIG, infra))
    assert mimo.unwrap_megatron_mimo_model([model]) is model
    fp16_config = dataclasses.replace(copy.copy(model.config), bf16=True)
    wrapped = Float16Module(fp16_config, model)  # converts the model to bf16 in place
    ddp = torch.nn.parallel.DistributedDataParallel(wrapped, process_group=pgs.dp)
    assert mimo.unwrap_megatron_mimo_model(ddp) is wrapped.module
    with pytest.raises(RuntimeError, match="cannot unwrap Linear to a MimoModel"):
        mimo.unwrap_megatron_mimo_model(torch.nn.Linear(1, 1))
    pairs = mimo.get_module_to_grid_tuple(ddp, infra)
    out["module_types"] = [type(m).__name__ for m, _ in pairs]
    assert [g for _, g in pairs] == [grids[name]]

    # no_sync reaches torch DDP modules; plain modules need nothing.
    plain = torch.nn.Linear(3, 3)
    ddp_module = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Linear(3, 3), process_group=pgs.dp
    )
    with mimo.multimodule_no_sync(
        module_to_grid_tuple=[(plain, grids[name]), (ddp_module, grids[name])]
    ):
        out["synced_inside"] = ddp_module.require_backward_grad_sync
    out["synced_after"] = ddp_module.require_backward_grad_sync

    # Gradient finalisation on plain modules with known gradients.
    module = torch.nn.Linear(2, 2)
    pair = [(module, grids[name])]

    def set_grads(value: float) -> None:
        for p in module.parameters():
            p.grad = torch.full_like(p, value)

    set_grads(rank + 1.0)
    mimo.finalize_model_grads_multimodule([module], infra=infra, module_to_grid_tuple=pair)
    assert module.weight.grad is not None
    out["mean_mode"] = float(module.weight.grad[0, 0])
    set_grads(rank + 1.0)
    tokens = torch.tensor(0 if name == "vision" else 10 + rank)  # only the TP leader counts
    mimo.finalize_model_grads_multimodule(
        [module], tokens, None, True, infra=infra, module_to_grid_tuple=pair
    )
    assert module.weight.grad is not None
    out["per_token"] = float(module.weight.grad[0, 0])

    # Unused parameters still reduce (a zero gradient is materialised on every replica).
    module.bias.grad = None
    module.weight.grad = torch.ones_like(module.weight)
    mimo.finalize_model_grads_multimodule([module], infra=infra, module_to_grid_tuple=pair)
    assert module.bias.grad is not None
    out["unused_bias_grad"] = module.bias.grad.abs().sum().item()

    # An infra with only the reference's fields (Megatron-Bridge's MegatronMIMOInfra): no
    # language_module_name, so the language module is found under MIMO_LANGUAGE_MODULE_KEY.
    reference_infra = SimpleNamespace(
        module_to_grid_map=infra.module_to_grid_map,
        topology=infra.topology,
        pg_collections=infra.pg_collections,
        participating_modules=infra.participating_modules,
        module_output_ndim={n: 3 for n in infra.module_to_grid_map},
    )
    set_grads(rank + 1.0)
    mimo.finalize_model_grads_multimodule(
        [module], infra=reference_infra, module_to_grid_tuple=pair
    )
    assert float(module.weight.grad[0, 0]) == out["mean_mode"]
    set_grads(rank + 1.0)
    mimo.finalize_model_grads_multimodule(
        [module], tokens, None, True, infra=reference_infra, module_to_grid_tuple=pair
    )
    assert float(module.weight.grad[0, 0]) == out["per_token"]
    assert [g for _, g in mimo.get_module_to_grid_tuple(ddp, reference_infra)] == [grids[name]]
    reference_pgs = mimo.build_pg_collection_for_schedule(reference_infra)
    assert reference_pgs.has_language_model() == (name == "language")
    mimo.validate_data_loader_contract(reference_infra, 8, 4, 2)
    unnamed = SimpleNamespace(
        module_to_grid_map={"vision": grids["vision"], "llm": grids["language"]},
        pg_collections={},
    )
    with pytest.raises(
        ValueError, match=r"no 'language' module .* set infra\.language_module_name"
    ):
        mimo.build_pg_collection_for_schedule(unnamed)

    # Gradient buffers.
    buffered = _BufferedModule()
    buffered.linear.weight.grad = torch.ones_like(buffered.linear.weight)
    mimo.zero_grad_buffer_for_multimodule([(module, grids[name]), (buffered, grids[name])])
    out["zeroed"] = (module.weight.grad is None, buffered.resets)
    infra.destroy()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_reference_utilities_on_a_fan_in_layout(harness: SimpleNamespace) -> None:
    results = run_distributed(_utilities_on_ranks, 4, harness, timeout=150)
    for rank, out in enumerate(results):
        module = "vision" if rank < 2 else "language"
        assert out["participating"] == [module]
        assert out["in_grid"] == {"vision": rank < 2, "language": rank >= 2}
        assert out["dp_sizes"] == {"vision": 2, "language": 1}  # known outside the grid too
        assert out["schedule"] == ([module], module == "language")
        assert out["synced_inside"] is False and out["synced_after"] is True
        assert out["zeroed"] == (True, 1)
        assert out["unused_bias_grad"] == 0.0
    assert results[0]["active"] == ("vision", 1, 2, [0, 1])
    assert results[3]["active"] == ("language", 2, 1, [3])
    assert results[0]["module_types"] == ["VisionModalitySubmodules"]
    assert results[2]["module_types"] == ["GPTModel"]
    # Mean mode: vision averages ranks 0,1 (1.5) and is rescaled by encoder_dp/llm_dp = 2.
    assert [r["mean_mode"] for r in results] == [3.0, 3.0, 3.0, 4.0]
    # Per-token mode: sums over DP, divided by the job's 12 loss tokens (rank 2 counts).
    assert [r["per_token"] for r in results] == pytest.approx([3 / 12, 3 / 12, 3 / 12, 4 / 12])


def _colocated_active_module(rank: int, world_size: int, harness: SimpleNamespace) -> str:
    layout = {
        "vision": {"ranks": range(0, 2), "dp": 2},
        "language": {"ranks": range(0, 2), "dp": 2},
    }
    infra = mimo.build_megatron_mimo_infra(harness.make_layout(layout))
    try:
        with pytest.raises(AssertionError, match=r"runs 2 modules .* needs exactly one"):
            mimo.get_active_module_pg(infra)
        schedule_pgs = mimo.build_pg_collection_for_schedule(infra)
        return f"{sorted(schedule_pgs.keys())} {schedule_pgs.language_model_module_name}"
    finally:
        infra.destroy()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_colocated_ranks_have_no_single_active_module(harness: SimpleNamespace) -> None:
    assert (
        run_distributed(_colocated_active_module, 2, harness, timeout=90)
        == ["['language', 'vision'] language"] * 2
    )


def _bad_world(rank: int, world_size: int, harness: SimpleNamespace) -> None:
    mimo.build_megatron_mimo_infra(harness.make_layout(FAN_IN))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_infra_refuses_a_layout_larger_than_the_world(harness: SimpleNamespace) -> None:
    from core_utils.testing import DistributedTestError

    with pytest.raises(
        DistributedTestError, match="module 'language' uses ranks 2-3 but the world has only 2"
    ):
        run_distributed(_bad_world, 2, harness, timeout=90)


def test_infra_needs_torch_distributed(harness: SimpleNamespace) -> None:
    if dist.is_initialized():  # pragma: no cover - only when run inside a launcher
        pytest.skip("torch.distributed is initialised in this process")
    with pytest.raises(
        RuntimeError, match=r"needs an initialised torch\.distributed default group"
    ):
        mimo.build_megatron_mimo_infra(harness.make_layout(FAN_IN))
