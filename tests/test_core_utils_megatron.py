"""core_utils functions that use megatron-core, with megatron-core installed (2 gloo ranks).

The checkpoint helpers must describe shards so that dist_checkpointing reassembles them; the
other helpers must find their groups in megatron's parallel_state when it is initialised.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import core_utils
from core_utils.testing import run_distributed

pytest.importorskip("megatron.core")  # the integration venv always has it

# Imported before the ranks fork, so each rank does not pay megatron's import time again.
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.strategies.filesystem_async import (
    get_write_results_queue,
)
from megatron.core.inference.config import MambaInferenceStateConfig


def _fork_context_results_queue() -> None:
    """Create dist_checkpointing's write-results queue with a fork-context Manager.

    By default save creates it on first use from a *spawn* context: a fresh interpreter that
    re-imports the main module, torch and megatron-core (about a minute per rank on a loaded
    2-core machine, for a save that takes milliseconds). A per-rank fork of the already
    loaded rank costs nothing. Called on each rank: ranks must not share one queue.
    """
    get_write_results_queue(mp_mode="fork")


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


FULL_WEIGHT = torch.arange(12, dtype=torch.float32).reshape(4, 3)
BIAS = torch.tensor([1.0, 2.0, 3.0])


def _default_tp_group_before_initialisation(out: dict[str, Any]) -> None:
    """torch.distributed is up but megatron's parallel_state is not: no default group."""
    assert not parallel_state.is_initialized()
    try:
        core_utils.get_tensor_model_parallel_group_if_none(None)
        out["uninitialised_error"] = None
    except RuntimeError as exc:
        out["uninitialised_error"] = str(exc)
    out["uninitialised_unchecked"] = (
        core_utils.get_tensor_model_parallel_group_if_none(None, check_initialized=False),
        core_utils.get_tensor_model_parallel_group_if_none(
            None, is_expert=True, check_initialized=False
        ),
    )
    explicit = dist.new_group([0, 1])
    assert isinstance(explicit, dist.ProcessGroup)  # both ranks are members
    out["uninitialised_explicit"] = (
        core_utils.get_tensor_model_parallel_group_if_none(explicit) is explicit
    )


def _tensor_parallel_checks(rank: int, ckpt_dir: str, out: dict[str, Any]) -> None:
    _default_tp_group_before_initialisation(out)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        shard = FULL_WEIGHT.chunk(2, dim=0)[rank].clone()
        weight = core_utils.make_tp_sharded_tensor_for_checkpoint(shard, "layer.weight")
        bias = core_utils.make_sharded_tensor_for_checkpoint(BIAS.clone(), "layer.bias")
        out["weight_meta"] = (
            tuple(weight.global_shape),
            tuple(weight.global_offset),
            weight.replica_id,
        )
        out["bias_meta"] = (tuple(bias.global_shape), tuple(bias.global_offset), bias.replica_id)
        # Explicit groups give the same description as parallel_state's.
        explicit = core_utils.make_tp_sharded_tensor_for_checkpoint(
            shard,
            "layer.weight",
            tp_group=parallel_state.get_tensor_model_parallel_group(),
            dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
        )
        out["explicit_same"] = (
            tuple(explicit.global_offset) == tuple(weight.global_offset)
            and explicit.replica_id == weight.replica_id
        )
        prepended = core_utils.make_tp_sharded_tensor_for_checkpoint(
            shard, "stacked", prepend_offsets=((0, 0, 1),)
        )
        out["prepended_shape"] = tuple(prepended.global_shape)
        with core_utils.cpu_cuda_compat():
            dist_checkpointing.save({"w": weight, "b": bias}, ckpt_dir)
        empty_w = core_utils.make_tp_sharded_tensor_for_checkpoint(
            torch.zeros_like(shard), "layer.weight"
        )
        empty_b = core_utils.make_sharded_tensor_for_checkpoint(torch.zeros(3), "layer.bias")
        loaded = dist_checkpointing.load({"w": empty_w, "b": empty_b}, ckpt_dir)
        out["loaded_weight"] = loaded["w"].tolist()
        out["loaded_bias"] = loaded["b"].tolist()

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            group = core_utils.get_tensor_model_parallel_group_if_none(None)
        out["default_tp_group"] = group is parallel_state.get_tensor_model_parallel_group()
        out["tp_warning"] = any(issubclass(w.category, DeprecationWarning) for w in caught)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            expert = core_utils.get_tensor_model_parallel_group_if_none(None, is_expert=True)
            unchecked = core_utils.get_tensor_model_parallel_group_if_none(
                None, check_initialized=False
            )
        out["default_expert_tp_group"] = (
            expert is parallel_state.get_expert_tensor_parallel_group()
            and dist.get_process_group_ranks(expert) == [0, 1]
        )
        out["default_tp_group_unchecked"] = (
            unchecked is parallel_state.get_tensor_model_parallel_group()
        )

        handler = _ListHandler()
        log = logging.getLogger(f"test.core_utils.megatron.{rank}")
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        core_utils.log_on_each_pipeline_stage(log, logging.INFO, "stage")
        out["stage_logged"] = handler.messages
    finally:
        parallel_state.destroy_model_parallel()


def _data_and_context_parallel_checks(rank: int, out: dict[str, Any]) -> None:
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    try:
        tokens = torch.arange(8).unsqueeze(0)
        out["cp"] = core_utils.get_batch_on_this_cp_rank({"tokens": tokens})["tokens"].tolist()
    finally:
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel()  # TP=1: DP=2
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 3)
        out["dp_same"] = core_utils.check_param_hashes_across_dp_replicas([model], cross_check=True)
        if rank == 1:
            with torch.no_grad():
                model.weight[0, 0] += 1.0
        out["dp_diverged"] = core_utils.check_param_hashes_across_dp_replicas(
            [model], cross_check=True
        )
    finally:
        parallel_state.destroy_model_parallel()


def _on_ranks(rank: int, world_size: int, ckpt_dir: str) -> dict[str, Any]:
    _fork_context_results_queue()
    out: dict[str, Any] = {}
    _tensor_parallel_checks(rank, ckpt_dir, out)
    _data_and_context_parallel_checks(rank, out)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_megatron_backed_helpers_on_two_gloo_ranks(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    ckpt_dir.mkdir()
    results = run_distributed(_on_ranks, 2, str(ckpt_dir), timeout=220)
    for rank, out in enumerate(results):
        # TP shard: rows 2*rank..2*rank+1 of a [4, 3] tensor; DP rank 0 is the main replica.
        assert out["weight_meta"] == ((4, 3), (2 * rank, 0), (0, 0, 0))
        # Replicated: only TP rank 0 writes it.
        assert out["bias_meta"] == ((3,), (0,), (0, rank, 0))
        assert out["explicit_same"] is True
        assert out["prepended_shape"] == (1, 4, 3)
        assert out["loaded_weight"] == FULL_WEIGHT.chunk(2, dim=0)[rank].tolist()
        assert out["loaded_bias"] == BIAS.tolist()
        assert out["uninitialised_error"] is not None
        assert "initialize_model_parallel" in out["uninitialised_error"]
        assert "tp_group=" in out["uninitialised_error"]
        assert out["uninitialised_unchecked"] == (None, None)
        assert out["uninitialised_explicit"] is True
        assert out["default_tp_group"] is True
        assert out["default_expert_tp_group"] is True
        assert out["default_tp_group_unchecked"] is True
        assert out["tp_warning"] is (rank == 0)
        assert out["dp_same"] is True and out["dp_diverged"] is False
    assert results[0]["stage_logged"] == ["stage"] and results[1]["stage_logged"] == []
    assert results[0]["cp"] == [[0, 1, 6, 7]] and results[1]["cp"] == [[2, 3, 4, 5]]


class _Mixer:
    chunk_size = 64


class _Layer(torch.nn.Module):
    def __init__(self, mamba: bool) -> None:
        super().__init__()
        if mamba:
            self.mixer = _Mixer()


class _HybridDecoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer_type_list = ["*", "M", "-"]
        self.layers = torch.nn.ModuleList([_Layer(False), _Layer(True), _Layer(False)])

    def mamba_state_shapes_per_request(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (8, 4), (2, 16, 8)


class _Config:
    params_dtype = torch.bfloat16


class _HybridModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.decoder = _HybridDecoder()
        self.config = _Config()


class _Wrapped(torch.nn.Module):
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


def test_mamba_inference_state_config_of_a_hybrid_model() -> None:
    config = core_utils.get_mamba_inference_state_config_from_model(_Wrapped(_HybridModel()))
    assert isinstance(config, MambaInferenceStateConfig)
    assert config.layer_type_list == ["*", "M", "-"]
    assert tuple(config.conv_states_shape) == (8, 4)
    assert tuple(config.ssm_states_shape) == (2, 16, 8)
    assert config.conv_states_dtype == torch.bfloat16 == config.ssm_states_dtype
    assert config.mamba_chunk_size == 64
    plain = _HybridModel()
    plain.decoder.layer_type_list = ["*", "-"]
    assert core_utils.get_mamba_inference_state_config_from_model(plain) is None
    assert dist.is_initialized() is False
