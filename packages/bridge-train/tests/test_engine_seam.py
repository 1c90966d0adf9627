"""Engine selection and the refusals that must happen before anything is built."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from bridge.config import DistributedDataParallelConfig
from bridge.train.engine import Engine, MegatronEngine, build_engine
from bridge.train.engine.initialize import resolve_distributed_backend, validate_parallel_layout
from bridge.train.engine.portable import PortableEngine
from bridge.train.engine.portable_ddp import PortableDistributedDataParallel
from bridge.train.testing import tiny_dist_config, tiny_gpt_provider


def test_build_engine_by_name() -> None:
    engine = build_engine("portable")
    assert isinstance(engine, PortableEngine) and isinstance(engine, Engine)
    assert engine.name == "portable" and engine.device == torch.device("cpu")
    with pytest.raises(ValueError, match=r"train.engine='fast'"):
        build_engine("fast")


def test_megatron_engine_builds_on_cpu_without_touching_process_state() -> None:
    """No CUDA refusal any more: the engine exists; the CUDA emulation starts only with
    initialize_distributed (tests/test_megatron_engine_layouts.py runs it)."""
    from core_utils import cuda_emulation_active

    engine = build_engine("megatron")
    assert isinstance(engine, MegatronEngine) and isinstance(engine, Engine)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert engine.name == "megatron" and engine.device.type == expected
    assert not cuda_emulation_active() and not dist.is_initialized()


def _megatron_engine_lifetime(rank: int, world_size: int) -> dict[str, object]:
    from megatron.core import tensor_parallel

    from bridge.train.engine.initialize import destroy_distributed
    from core_utils import cuda_emulation_active

    original_stream = torch.cuda.current_stream
    engine = build_engine("megatron")
    engine.initialize_distributed(tiny_gpt_provider(), tiny_dist_config())
    out: dict[str, object] = {
        "active_after_init": cuda_emulation_active(),
        "tracker_seeded": tensor_parallel.get_cuda_rng_tracker().is_initialized(),
        "device": str(engine.device),
        "cuda_tensor": str(torch.zeros(1, device="cuda").device),
    }
    destroy_distributed()
    out["active_after_destroy"] = cuda_emulation_active()
    out["restored"] = torch.cuda.current_stream is original_stream
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU emulation path")
def test_megatron_engine_enters_the_emulation_for_the_run_and_teardown_exits_it() -> None:
    from core_utils.testing import run_distributed

    (out,) = run_distributed(_megatron_engine_lifetime, 1, timeout=280)
    assert out == {
        "active_after_init": True,
        "tracker_seeded": True,
        "device": "cpu",
        "cuda_tensor": "cpu",
        "active_after_destroy": False,
        "restored": True,
    }


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only machine")
def test_nccl_without_cuda_is_refused_with_the_field_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"dist.distributed_backend='nccl' requires CUDA.*'gloo'"):
        resolve_distributed_backend(tiny_dist_config(distributed_backend="nccl"))
    assert resolve_distributed_backend(tiny_dist_config()) == "gloo"
    assert resolve_distributed_backend(None) == "gloo"
    assert resolve_distributed_backend(SimpleNamespace(distributed_backend="auto")) == "gloo"
    with pytest.raises(ValueError, match=r"'mpi' is not one of"):
        resolve_distributed_backend(SimpleNamespace(distributed_backend="mpi"))


def test_parallel_layout_is_checked_against_world_size_and_engine() -> None:
    validate_parallel_layout(tiny_gpt_provider(tensor_model_parallel_size=2), 4)
    with pytest.raises(
        ValueError, match=r"world size 3 is not divisible.*tensor_model_parallel_size \(2\)"
    ):
        validate_parallel_layout(tiny_gpt_provider(tensor_model_parallel_size=2), 3)
    pipelined = tiny_gpt_provider(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"pipeline_model_parallel_size=2.*megatron engine"):
        validate_parallel_layout(pipelined, 2, "portable")
    validate_parallel_layout(pipelined, 2, "megatron")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only machine")
def test_cpu_only_features_are_refused_by_the_portable_engine() -> None:
    with pytest.raises(ValueError, match=r"sequence_parallel=True needs CUDA"):
        validate_parallel_layout(
            tiny_gpt_provider(tensor_model_parallel_size=2, sequence_parallel=True), 2, "portable"
        )
    with pytest.raises(ValueError, match=r"num_moe_experts=4.*CUDA"):
        validate_parallel_layout(tiny_gpt_provider(num_moe_experts=4), 1, "portable")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("use_distributed_optimizer", True),
        ("overlap_param_gather", True),
        ("num_distributed_optimizer_instances", 2),
    ],
)
def test_portable_ddp_refuses_megatron_only_options(field: str, value) -> None:
    defaults = {
        f: getattr(DistributedDataParallelConfig(), f)
        for f in (
            "use_distributed_optimizer",
            "overlap_param_gather",
            "num_distributed_optimizer_instances",
        )
    }
    ddp = SimpleNamespace(**{**defaults, field: value})
    with pytest.raises(ValueError, match=f"ddp.{field}.*megatron engine"):
        PortableDistributedDataParallel(
            SimpleNamespace(calculate_per_token_loss=False),
            ddp,
            torch.nn.Linear(2, 2),
            data_parallel_group=None,
            expert_data_parallel_group=None,
        )
