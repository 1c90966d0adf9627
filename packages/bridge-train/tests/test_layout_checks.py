"""Config-time refusal of layouts and features the engine would run wrongly or not at all.

The p2p rule is checked here as a rule; ``tests/test_megatron_pipeline_p2p.py`` shows on two
ranks that the refused combination really trains on swapped tensors.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from bridge.config import ConfigError
from bridge.train import GPTModelProvider
from bridge.train.checks.layout import check_engine_config, check_pipeline_p2p
from bridge.train.cli import EXIT_CONFIG_ERROR, main


def _model(**fields: Any) -> GPTModelProvider:
    fields.setdefault("pipeline_dtype", torch.float32)
    return GPTModelProvider(vocab_size=128, num_layers=4, **fields)


def _error(fn: Any, *args: Any, **kwargs: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return info.value


@pytest.mark.parametrize("cuda", [False, True])
def test_pp2_with_virtual_pipeline_and_batched_p2p_is_refused(cuda: bool) -> None:
    model = _model(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    assert model.batch_p2p_comm and not model.overlap_p2p_comm  # megatron's defaults
    error = _error(check_engine_config, model, cuda_available=cuda)
    assert error.location == "model.batch_p2p_comm"
    assert "swapped activations and gradients" in error.detail
    assert "model.overlap_p2p_comm=True and model.batch_p2p_comm=False" in error.detail


@pytest.mark.parametrize(
    ("pp", "vp", "batched", "overlap"),
    [
        (2, 2, False, True),  # what Megatron-LM selects for PP=2 with a virtual pipeline
        (2, 2, False, False),  # unbatched: ordered by rank parity, two communicators
        (4, 2, True, False),  # previous and next stage differ
        (2, None, True, False),  # 1F1B: one direction per stage
        (1, None, True, False),
    ],
)
def test_correct_p2p_modes_are_accepted(
    pp: int, vp: int | None, batched: bool, overlap: bool
) -> None:
    model = _model(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        batch_p2p_comm=batched,
        overlap_p2p_comm=overlap,
    )
    check_pipeline_p2p(model)


def test_exclusive_p2p_settings_are_refused() -> None:
    both = _model(
        pipeline_model_parallel_size=4,
        virtual_pipeline_model_parallel_size=2,
        batch_p2p_comm=True,
        overlap_p2p_comm=True,
    )
    error = _error(check_pipeline_p2p, both)
    assert error.location == "model.overlap_p2p_comm" and "exclude each other" in error.detail
    no_vpp = _model(pipeline_model_parallel_size=2, batch_p2p_comm=False, overlap_p2p_comm=True)
    error = _error(check_pipeline_p2p, no_vpp)
    assert "needs the interleaved schedule" in error.detail


@pytest.mark.parametrize(
    ("fields", "location", "words"),
    [
        ({"fp8": "hybrid"}, "model.fp8", "Transformer Engine"),
        ({"enable_cuda_graph": True}, "model.enable_cuda_graph", "CUDA graphs"),
        ({"cuda_graph_impl": "local"}, "model.cuda_graph_impl", "CUDA graphs"),
        ({"gradient_accumulation_fusion": True}, "model.gradient_accumulation_fusion", "Apex"),
        ({"cpu_offloading": True}, "model.cpu_offloading", "CUDA streams"),
        ({"context_parallel_size": 2}, "model.context_parallel_size", "Transformer Engine"),
        ({"layer_spec_backend": "transformer_engine"}, "model.layer_spec_backend", "CUDA"),
        ({"layer_spec_backend": "local"}, "model.layer_spec_backend", "CUDA"),
    ],
)
def test_megatron_engine_on_cpu_refuses_gpu_only_features(
    fields: dict[str, Any], location: str, words: str
) -> None:
    model = _model(**fields)
    error = _error(check_engine_config, model, cuda_available=False)
    assert error.location == location and words in error.detail, error
    # The same model is not refused on CUDA by this check (megatron runs it there).
    if location != "model.layer_spec_backend":
        check_engine_config(model, cuda_available=True)


def test_megatron_engine_on_cpu_refuses_gpu_only_ddp_and_optimizer_settings() -> None:
    model = _model()
    check_engine_config(model, cuda_available=False)
    error = _error(
        check_engine_config,
        model,
        ddp_config=SimpleNamespace(use_megatron_fsdp=True),
        cuda_available=False,
    )
    assert error.location == "ddp.use_megatron_fsdp"
    error = _error(
        check_engine_config,
        model,
        optimizer_config=SimpleNamespace(use_precision_aware_optimizer=True),
        cuda_available=False,
    )
    assert error.location == "optimizer.use_precision_aware_optimizer"


def test_bridge_train_exits_2_naming_the_field(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A torchrun-like environment of two ranks; the layout check refuses before any
    # process group is created.
    for name, value in {
        "WORLD_SIZE": "2",
        "RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as info:
        main(
            [
                "--no-print-config",
                "model.num_layers=4",
                "model.pipeline_model_parallel_size=2",
                "model.virtual_pipeline_model_parallel_size=2",
                "model.pipeline_dtype=float32",
            ]
        )
    assert info.value.code == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    line = err.splitlines()[-1]  # megatron's config may warn first (its own deprecations)
    assert line.startswith("bridge-train: error: ") and "Traceback" not in err
    assert "model.batch_p2p_comm: batch_p2p_comm=True with pipeline_model_parallel" in line, err
