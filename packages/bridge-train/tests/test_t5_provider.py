"""T5ModelProvider, the generated span-corruption data and the T5 forward step."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from bridge.config import ConfigContainer, ConfigError
from bridge.train import T5ModelProvider
from bridge.train.data.t5_datasets import MOCK_SENTINELS, MockT5Dataset, T5DatasetConfig
from bridge.train.metrics.flops import num_floating_point_operations
from bridge.train.models.family import build_family_datasets, default_forward_step
from core_utils.testing import find_free_port, run_distributed


def _tiny(**overrides):
    values: dict[str, Any] = {
        "num_layers": 2,
        "encoder_num_layers": 1,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "seq_length": 24,
        "seq_length_dec": 12,
        "vocab_size": 128,
        "make_vocab_size_divisible_by": 64,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    }
    values.update(overrides)
    return T5ModelProvider(**values)


def _data(**overrides):
    values: dict[str, Any] = {"random_seed": 7, "sequence_length": 24, "sequence_length_dec": 12}
    values.update(overrides)
    return T5DatasetConfig(**values)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"seq_length_dec": 0}, "seq_length_dec must be a positive integer"),
        ({"max_position_embeddings": 16}, "shorter than the longest sequence"),
        ({"pipeline_model_parallel_size": 2}, "not supported for T5"),
        ({"rope_scaling": True}, "rope_scaling"),
        ({"tensor_model_parallel_size": 3}, "tensor_model_parallel_size=3"),
    ],
)
def test_bad_t5_fields_are_refused(overrides, match) -> None:
    with pytest.raises(ValueError, match=match):
        _tiny(**overrides)


def test_backend_choice() -> None:
    assert _tiny().resolved_layer_spec_backend() == "portable"
    with pytest.raises(ValueError, match="not supported for T5"):
        _tiny(layer_spec_backend="transformer_engine").resolved_layer_spec_backend()
    assert _tiny().position_table_length == 24 and _tiny().encoder_layers == 1
    assert _tiny(max_position_embeddings=40).position_table_length == 40


def test_generated_samples_are_span_corruption_in_megatron_layout() -> None:
    cfg = _data(masking_probability=0.3)
    ds = MockT5Dataset(50, cfg, 128, 0)
    sentinels = set(range(128 - MOCK_SENTINELS, 128))
    saw_span = False
    for i in range(50):
        s = ds[i]
        assert {k: v.shape for k, v in s.items() if k != "truncated"} == {
            "text_enc": (24,),
            "text_dec": (12,),
            "labels": (12,),
            "loss_mask": (12,),
            "enc_mask": (24,),
            "dec_mask": (12,),
        }
        n_dec = int(s["loss_mask"].sum())
        assert s["text_dec"][0] == 1 and s["labels"][n_dec - 1] == 2  # bos ... eos
        np.testing.assert_array_equal(s["labels"][: n_dec - 1], s["text_dec"][1:n_dec])
        enc = s["text_enc"][s["enc_mask"] == 1]
        used = [t for t in enc if t in sentinels]
        assert used == [t for t in s["text_dec"][:n_dec] if t in sentinels]
        saw_span |= bool(used)
        # Putting the spans back gives the original counting sequence.
        spans: dict[Any, list[Any]] = {}
        current = None
        for t in s["text_dec"][1:n_dec]:
            if t in sentinels:
                current = t
                spans[t] = []
            else:
                spans[current].append(t)
        rebuilt = [x for t in enc for x in (spans[t] if t in sentinels else [t])]
        assert len(rebuilt) == 24 and np.all(np.diff(rebuilt) % (128 - MOCK_SENTINELS - 3) == 1)
        np.testing.assert_array_equal(ds[i]["text_enc"], s["text_enc"])  # deterministic
    assert saw_span
    assert not np.array_equal(MockT5Dataset(1, cfg, 128, 1)[0]["text_enc"], ds[0]["text_enc"])


def test_data_config_refuses_what_it_does_not_read() -> None:
    with pytest.raises(ConfigError, match=r"dataset\.masking_max_ngram: is read only with"):
        _data(masking_max_ngram=3)  # generated data: an indexed-data option
    with pytest.raises(ConfigError, match=r"dataset\.masking_do_permutation"):
        _data(masking_do_permutation=True)
    with pytest.raises(ConfigError, match=r"dataset\.add_extra_token_to_sequence: is a GPT"):
        _data(add_extra_token_to_sequence=False)
    with pytest.raises(ConfigError, match=r"dataset\.eod_mask_loss"):
        _data(eod_mask_loss=True)
    with pytest.raises(ConfigError, match=r"dataset\.masking_probability"):
        _data(masking_probability=1.5)


def test_indexed_masking_fields_reach_megatrons_dataset_config() -> None:
    # Indexed data hands every masking field to megatron's T5 dataset config by name; one
    # megatron does not have would be dropped there without a word.
    import dataclasses

    from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDatasetConfig

    from bridge.train.data.t5_datasets import _INDEXED_ONLY

    megatron_fields = {f.name for f in dataclasses.fields(T5MaskedWordPieceDatasetConfig)}
    read = {*_INDEXED_ONLY, "masking_probability", "masking_do_permutation"}
    assert read <= megatron_fields, read - megatron_fields


def test_family_dispatch_checks_model_and_data_agree() -> None:
    from bridge.train import forward_step, t5_forward_step
    from bridge.train.data import NullTokenizer
    from bridge.train.testing import tiny_gpt_provider, tiny_mock_dataset_config

    assert default_forward_step(_tiny()) is t5_forward_step
    assert default_forward_step(tiny_gpt_provider()) is forward_step
    tok = NullTokenizer(128)
    with pytest.raises(ConfigError, match="T5 span-corruption data"):
        build_family_datasets(_tiny(), tiny_mock_dataset_config(), tok, (4, 0, 0))
    with pytest.raises(ConfigError, match="needs a T5ModelProvider"):
        build_family_datasets(tiny_gpt_provider(), _data(), tok, (4, 0, 0))
    with pytest.raises(ConfigError, match="sequence_length_dec"):
        build_family_datasets(_tiny(), _data(sequence_length_dec=10), tok, (4, 0, 0))
    train, valid, test = build_family_datasets(_tiny(), _data(), tok, (4, 2, 0))
    assert len(train) == 4 and len(valid) == 2 and test is None


def test_flops_count_encoder_decoder_and_cross_attention() -> None:
    p = _tiny(num_layers=1, encoder_num_layers=1)
    b, h, se, sd, v = 2, 32, 24, 12, 128
    mlp = lambda s: 4 * b * s * h * 4 * h  # noqa: E731
    attn = lambda s, k: 2 * b * s * h * 3 * h + 2 * b * s * h * h + 4 * b * s * h * k  # noqa: E731
    cross = 2 * b * sd * h * h + 4 * b * se * h * h + 2 * b * sd * h * h + 4 * b * sd * h * se
    want = 3 * (attn(se, se) + mlp(se) + attn(sd, sd / 2) + cross + mlp(sd) + 2 * b * sd * h * v)
    assert num_floating_point_operations(p, b) == pytest.approx(want)


def test_yaml_round_trip(tmp_path) -> None:
    path = tmp_path / "config.yaml"
    ConfigContainer(model=_tiny()).to_yaml(path)
    loaded = ConfigContainer.from_yaml(path).model
    assert type(loaded) is T5ModelProvider and loaded.seq_length_dec == 12


def _build_and_step(rank: int, world: int, provider: T5ModelProvider, port: int):
    from bridge.config import StragglerDetectionConfig
    from bridge.resiliency import StragglerTiming
    from bridge.train import GlobalState, t5_forward_step
    from bridge.train.engine.initialize import initialize_distributed
    from bridge.train.testing import tiny_dist_config

    initialize_distributed(provider, tiny_dist_config())
    model = provider.provide()
    ds = MockT5Dataset(2, _data(), 128, 0)
    batch = {k: torch.stack([torch.as_tensor(ds[i][k]) for i in range(2)]) for k in ds[0]}
    # Straggler detection on, as a run with a straggler section has it: the T5 step times
    # its batch fetch and forward pass for the report as the GPT step does.
    straggler = StragglerDetectionConfig(log_straggler=True, straggler_ctrlr_port=port)
    state = GlobalState(straggler_timing=StragglerTiming.from_config(straggler))
    try:
        output, loss_func = t5_forward_step(state, iter([batch]), model)
        state.straggler_timing.maybe_report(1, total_flops=1e9, log_interval=1)
        report = state.straggler_timing.last_report
    finally:
        state.straggler_timing.close()
    loss, tokens, _ = loss_func(output)
    loss.backward()
    finite = all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    cross = model.decoder.layers[0].cross_attention.core_attention
    assert report is not None
    timed = (report.max_elapsed.value, report.max_btime.value)
    return type(cross).__name__, float(loss), int(tokens), finite, timed


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
# RoPE: megatron's RotaryEmbedding moves its frequencies to the current CUDA device on the
# first forward; the provider keeps them on the CPU when there is no GPU.
@pytest.mark.parametrize("position_embedding_type", ["learned_absolute", "rope"])
def test_builds_t5_with_sdpa_cross_attention_and_takes_a_finite_step(
    position_embedding_type: str,
) -> None:
    provider = _tiny(position_embedding_type=position_embedding_type)
    ((cross, loss, tokens, finite, (forward_ms, fetch_ms)),) = run_distributed(
        _build_and_step, 1, provider, find_free_port(), timeout=200
    )
    assert cross == "SDPACoreAttention"
    assert np.isfinite(loss) and tokens > 0 and finite
    assert forward_ms > 0 and fetch_ms > 0, "the T5 step was not timed for the straggler report"
