"""Behaviour without torch.distributed and without megatron-core."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

import core_utils


def test_process_group_helpers_uninitialised() -> None:
    assert core_utils.get_pg_size() == 1
    assert core_utils.get_pg_rank() == 0
    assert core_utils.get_pg_src_rank() == 0
    # No torch.distributed: no tensor parallelism, whatever check_initialized says.
    assert core_utils.get_tensor_model_parallel_group_if_none(None) is None
    assert core_utils.get_tensor_model_parallel_group_if_none(None, check_initialized=False) is None


def test_logging_on_a_single_process(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("core_utils.test")
    with caplog.at_level(logging.INFO, logger="core_utils.test"):
        core_utils.log_single_rank(log, logging.INFO, "hello %s", "world")
        core_utils.log_single_rank(log, logging.INFO, "also shown: no distributed", rank=3)
        core_utils.log_on_each_pipeline_stage(log, logging.INFO, "stage message")
    assert [r.getMessage() for r in caplog.records] == [
        "hello world",
        "also shown: no distributed",
        "stage message",
    ]
    with pytest.raises(ValueError, match="pass tp_group and dp_cp_group together"):
        core_utils.log_on_each_pipeline_stage(log, logging.INFO, "x", tp_group=object())  # type: ignore[arg-type]


def test_param_hashes_single_replica() -> None:
    model = torch.nn.Linear(3, 3)
    assert core_utils.check_param_hashes_across_dp_replicas([model]) is True
    assert core_utils.check_param_hashes_across_dp_replicas([model], cross_check=True) is True


def test_dtensor_helpers_pass_plain_tensors_through() -> None:
    tensor = torch.ones(2)
    assert core_utils.to_local_if_dtensor(tensor) is tensor
    assert core_utils.get_full_tensor_if_necessary(tensor) is tensor
    assert core_utils.get_data_parallel_group_if_dtensor(tensor) is None


def test_prepare_input_tensors_for_wgrad_compute() -> None:
    grad = torch.randn(4, 3, 5).transpose(0, 1)  # non-contiguous [3, 4, 5]
    inp = torch.randn(3, 4, 6)
    grad2d, inp2d = core_utils.prepare_input_tensors_for_wgrad_compute(grad, inp)
    assert grad2d.shape == (12, 5) and inp2d.shape == (12, 6)
    assert grad2d.is_contiguous() and inp2d.is_contiguous()
    torch.testing.assert_close(grad2d, grad.reshape(12, 5))
    flat_grad, flat_inp = core_utils.prepare_input_tensors_for_wgrad_compute(
        torch.randn(5, 2), torch.randn(5, 3)
    )
    assert flat_grad.shape == (5, 2) and flat_inp.shape == (5, 3)


class _Config:
    def __init__(self, sequence_parallel: bool, fusion: bool = True) -> None:
        self.sequence_parallel = sequence_parallel
        self.gradient_accumulation_fusion = fusion


def test_drain_embedding_wgrad_compute_without_sequence_parallel() -> None:
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.zeros(5, 6))
    weight.main_grad = torch.zeros(5, 6)  # type: ignore[attr-defined]
    activations = [torch.randn(3, 2, 6) for _ in range(3)]
    grads = [torch.randn(3, 2, 5) for _ in range(3)]
    expected = sum(
        g.reshape(-1, 5).t() @ a.reshape(-1, 6) for a, g in zip(activations, grads, strict=True)
    )
    core_utils.drain_embedding_wgrad_compute(
        _Config(False), list(activations), list(grads), weight, None
    )
    torch.testing.assert_close(weight.main_grad, expected)  # type: ignore[attr-defined]


def test_drain_embedding_wgrad_compute_bad_inputs() -> None:
    weight = torch.nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="has 2 entries but grad_output_buffer has 1"):
        core_utils.drain_embedding_wgrad_compute(
            _Config(False), [torch.ones(1, 2)] * 2, [torch.ones(1, 2)], weight, None
        )
    with pytest.raises(ValueError, match="gradient_accumulation_fusion=True"):
        core_utils.drain_embedding_wgrad_compute(
            _Config(False, fusion=False), [torch.ones(1, 2)], [torch.ones(1, 2)], weight, None
        )
    with pytest.raises(ValueError, match="no main_grad"):
        core_utils.drain_embedding_wgrad_compute(
            _Config(False), [torch.ones(1, 2)], [torch.ones(1, 2)], weight, None
        )


def test_megatron_functions_name_megatron_when_it_is_missing(without_megatron: None) -> None:
    import torch.distributed as dist

    with pytest.raises(
        ImportError,
        match=r"make_tp_sharded_tensor_for_checkpoint needs megatron-core.*pip install megatron-core",
    ):
        core_utils.make_tp_sharded_tensor_for_checkpoint(torch.ones(2), "w")
    with pytest.raises(ImportError, match="make_sharded_tensor_for_checkpoint needs megatron-core"):
        core_utils.make_sharded_tensor_for_checkpoint(torch.ones(2), "b")
    # tp_group=None under torch.distributed needs megatron's default group.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(
            ImportError,
            match=r"get_tensor_model_parallel_group_if_none\(tp_group=None\) needs megatron-core",
        ):
            core_utils.get_tensor_model_parallel_group_if_none(None)
        # Without megatron-core there is no default group; check_initialized=False accepts that.
        assert (
            core_utils.get_tensor_model_parallel_group_if_none(None, check_initialized=False)
            is None
        )
        assert (
            core_utils.get_tensor_model_parallel_group_if_none(
                None, is_expert=True, check_initialized=False
            )
            is None
        )
        group = dist.new_group([0])
        assert isinstance(group, dist.ProcessGroup)
        assert core_utils.get_tensor_model_parallel_group_if_none(group) is group
    finally:
        dist.destroy_process_group()
    assert sys.modules["megatron"] is None


class _Decoder(torch.nn.Module):
    def __init__(self, layer_type_list: list[str] | None) -> None:
        super().__init__()
        self.layer_type_list = layer_type_list


class _Model(torch.nn.Module):
    def __init__(self, layer_type_list: list[str] | None) -> None:
        super().__init__()
        self.decoder = _Decoder(layer_type_list)


def test_mamba_inference_state_config(without_megatron: None) -> None:
    assert core_utils.get_mamba_inference_state_config_from_model(torch.nn.Linear(1, 1)) is None
    assert core_utils.get_mamba_inference_state_config_from_model(_Model(None)) is None
    assert core_utils.get_mamba_inference_state_config_from_model(_Model(["*", "-"])) is None
    with pytest.raises(ImportError, match="needs megatron-core"):
        core_utils.get_mamba_inference_state_config_from_model(_Model(["M", "*", "-"]))
