"""The engine and the refusals that must happen before anything is built."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist

from bridge.config import data_parallel_size
from bridge.train.engine import Engine, MegatronEngine, build_engine
from bridge.train.engine.initialize import initialize_distributed, resolve_distributed_backend
from bridge.train.state import GlobalState
from bridge.train.testing import tiny_dist_config, tiny_gpt_provider, tiny_optimizer_config


def test_megatron_engine_is_the_engine_and_builds_without_touching_process_state() -> None:
    """The engine exists on CPU; the CUDA emulation starts only with initialize_distributed
    (tests/test_megatron_engine_layouts.py runs it)."""
    from core_utils import cuda_emulation_active

    engine = build_engine()
    assert isinstance(engine, MegatronEngine) and isinstance(engine, Engine)
    # The package's lazy names, listed by dir() before and after they load.
    import bridge.train.engine as package

    assert {"Engine", "MegatronEngine", "build_engine"} <= set(dir(package))
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert engine.name == "megatron" and engine.device.type == expected
    assert not cuda_emulation_active() and not dist.is_initialized()
    # A GlobalState built by hand (no engine set) takes megatron-core's engine.
    state = GlobalState()
    if not torch.cuda.is_available():
        # ... whose schedules need the emulation on CPU: said plainly, not a CUDA error
        # deep inside megatron-core.
        with pytest.raises(RuntimeError, match=r"initialize_distributed.*cuda_emulation"):
            state.forward_backward_func  # noqa: B018
    assert isinstance(state.engine, MegatronEngine)


def _megatron_engine_lifetime(rank: int, world_size: int) -> dict[str, object]:
    from megatron.core import parallel_state, tensor_parallel

    from bridge.train.engine.initialize import destroy_distributed
    from core_utils import cuda_emulation_active

    original_stream = torch.cuda.current_stream
    engine = build_engine()
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
    # No group outlives teardown (megatron-core 0.19.2 forgets one): a process forked later
    # would hang dropping it.
    out["groups_left"] = sorted(
        name
        for name, value in vars(parallel_state).items()
        if isinstance(value, torch.distributed.ProcessGroup)
    )
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
        "groups_left": [],
    }


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only machine")
def test_nccl_without_cuda_is_refused_with_the_field_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"dist.distributed_backend: 'nccl' requires CUDA.*'gloo'"):
        resolve_distributed_backend(tiny_dist_config(distributed_backend="nccl"))
    assert resolve_distributed_backend(tiny_dist_config()) == "gloo"
    assert resolve_distributed_backend(None) == "gloo"
    assert (
        resolve_distributed_backend(cast(Any, SimpleNamespace(distributed_backend="auto")))
        == "gloo"
    )
    with pytest.raises(ValueError, match=r"'mpi' is not one of"):
        resolve_distributed_backend(cast(Any, SimpleNamespace(distributed_backend="mpi")))


def test_parallel_layout_is_checked_against_world_size() -> None:
    # The engine applies bridge.config's layout rule before any process group exists.
    with pytest.raises(
        ValueError, match=r"world size 1 is not divisible.*tensor_model_parallel_size \(2\)"
    ):
        initialize_distributed(tiny_gpt_provider(tensor_model_parallel_size=2))
    assert not dist.is_initialized()
    data_parallel_size(tiny_gpt_provider(tensor_model_parallel_size=2), 4)
    with pytest.raises(
        ValueError, match=r"world size 3 is not divisible.*tensor_model_parallel_size \(2\)"
    ):
        data_parallel_size(tiny_gpt_provider(tensor_model_parallel_size=2), 3)
    with pytest.raises(ValueError, match=r"expert_model_parallel_size \(2\)"):
        data_parallel_size(
            tiny_gpt_provider(
                num_moe_experts=4, expert_model_parallel_size=2, add_bias_linear=False
            ),
            3,
        )


@pytest.mark.parametrize(
    "layout",
    [
        {"pipeline_model_parallel_size": 2, "pipeline_dtype": torch.float32},
        {
            "pipeline_model_parallel_size": 2,
            "virtual_pipeline_model_parallel_size": 2,
            "pipeline_dtype": torch.float32,
            "num_layers": 4,
            "batch_p2p_comm": False,  # see check_pipeline_p2p
        },
        {"num_moe_experts": 4, "expert_model_parallel_size": 2, "add_bias_linear": False},
    ],
    ids=["pp2", "pp2-vpp2", "moe-ep2"],
)
def test_pipeline_expert_and_distributed_optimizer_layouts_are_accepted_on_cpu(
    layout: dict,
) -> None:
    """What only the retired portable engine refused: megatron-core's engine runs them on
    CPU too (tests/test_megatron_engine_layouts.py trains each against one process)."""
    from bridge.config import DistributedDataParallelConfig
    from bridge.train.checks.layout import check_engine_config

    provider = tiny_gpt_provider(**layout)
    data_parallel_size(provider, 2)
    check_engine_config(
        provider,
        ddp_config=DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True
        ),
        optimizer_config=tiny_optimizer_config(use_distributed_optimizer=True),
        cuda_available=False,
    )


def test_initialize_distributed_passes_sharp_and_stream_priorities_and_the_experimental_flag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What megatron's ``initialize_model_parallel`` gets from the ``dist`` section (recorded,
    not run: SHARP and stream priorities need NCCL on CUDA, which the launch checks demand)."""
    import megatron.core.config as megatron_config
    from megatron.core import parallel_state

    import bridge.train.engine.initialize as initialize
    import core_utils

    calls: list[dict[str, Any]] = []
    monkeypatch.delenv(core_utils.experimental.ENV_VAR, raising=False)
    # No process group is made (one process, no launch); the module's record is restored.
    monkeypatch.setattr(initialize, "init_launch_process_group", lambda backend, timeout: None)
    monkeypatch.setitem(initialize._STATE, "owns_process_group", False)
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: False)
    monkeypatch.setattr(
        parallel_state, "initialize_model_parallel", lambda **kwargs: calls.append(kwargs)
    )
    assert not megatron_config.is_experimental_enabled()
    try:
        initialize_distributed(tiny_gpt_provider(), tiny_dist_config())
        assert not megatron_config.is_experimental_enabled()
        assert not core_utils.is_experimental_enabled()
        initialize_distributed(
            tiny_gpt_provider(),
            tiny_dist_config(
                use_sharp=True,
                high_priority_stream_groups=["dp", "tp"],
                enable_megatron_core_experimental=True,
            ),
        )
        assert megatron_config.is_experimental_enabled()
        assert core_utils.is_experimental_enabled()
    finally:
        megatron_config.set_experimental_flag(False)
        core_utils.set_experimental_enabled(False)
    assert [(c["use_sharp"], c["high_priority_stream_groups"]) for c in calls] == [
        (False, None),
        (True, ["dp", "tp"]),
    ]


def test_start_process_group_uses_the_sections_timeout_and_reuses_an_existing_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The one process-group start (GPT path and mimo recipe): the launch's group gets
    ``dist.distributed_timeout_minutes`` and the backend; an existing group is kept and the
    call says it created none. megatron's groups get the same minutes."""
    from datetime import timedelta

    from megatron.core import parallel_state

    import bridge.train.engine.initialize as initialize

    started: list[tuple[str, timedelta]] = []
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(initialize, "init_launch_process_group", lambda *args: started.append(args))
    monkeypatch.setitem(initialize._STATE, "owns_process_group", False)
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: False)
    monkeypatch.setattr(
        parallel_state, "initialize_model_parallel", lambda **kwargs: calls.append(kwargs)
    )
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    section = tiny_dist_config(distributed_timeout_minutes=3)
    assert initialize.start_process_group(section)
    initialize_distributed(tiny_gpt_provider(), section)
    assert initialize._STATE["owns_process_group"]
    assert started == [("gloo", timedelta(minutes=3))] * 2
    assert calls[0]["distributed_timeout_minutes"] == 3
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    assert not initialize.start_process_group(section)
    assert len(started) == 2
