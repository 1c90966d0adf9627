"""Packed sequences for Transformer Engine: megatron-core ``PackedSeqParams`` from a packed batch.

What can honestly run without a GPU: the parameters built from real packed samples
(boundaries against the packed examples, the padded variants, ``max_seqlen``, both
``pad_cu_seqlens`` settings), the forward step handing them to a model whose layer spec is
Transformer Engine (and not to a portable one, which gets the block-diagonal mask), and the
launch checks of the packed settings. Transformer Engine's attention itself needs a GPU.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from bridge.config import ConfigError, FinetuningDatasetConfig, PackedSequenceSpecs
from bridge.train import forward_step
from bridge.train.checks.preflight import check_section
from bridge.train.data.packing import (
    PackedSFTDataset,
    check_packed_sequence_specs,
    packed_seq_params as build_params,
)
from bridge.train.data.sft import load_tokenized_examples, sft_settings
from bridge.train.data.tokenizers import ByteLevelTokenizer
from bridge.train.models.mamba_provider import MambaProvider
from bridge.train.testing import (
    tiny_config_container,
    tiny_gpt_provider,
    tiny_train_config,
    write_tiny_sft_task,
)

SEQ = 32


def _packed(tmp_path: Path, pad_cu_seqlens: bool) -> PackedSFTDataset:
    root = write_tiny_sft_task(tmp_path / "data", train=16, valid=1)
    examples = load_tokenized_examples(
        root / "training.jsonl", ByteLevelTokenizer(), sft_settings(None)
    )
    return PackedSFTDataset(
        examples, SEQ, ByteLevelTokenizer().pad, shuffle_seed=None, pad_cu_seqlens=pad_cu_seqlens
    )


def _collate(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return torch.utils.data.default_collate([sample])


@pytest.mark.parametrize("pad_cu_seqlens", [False, True])
def test_packed_seq_params_from_packed_batches(tmp_path: Path, pad_cu_seqlens: bool) -> None:
    dataset = _packed(tmp_path, pad_cu_seqlens)
    for index in range(len(dataset)):
        lengths = [len(dataset.examples[i][0]) - 1 for i in dataset.bins[index]]
        bounds = [0]
        for length in lengths:
            bounds.append(bounds[-1] + length)
        params = build_params(_collate(dataset[index]))
        assert params.qkv_format == "thd"
        got = params.cu_seqlens_q.tolist()
        padded = params.cu_seqlens_q_padded.tolist()
        assert params.cu_seqlens_q.dtype == torch.int32
        assert torch.equal(params.cu_seqlens_kv, params.cu_seqlens_q)
        assert torch.equal(params.cu_seqlens_kv_padded, params.cu_seqlens_q_padded)
        # The last example takes the trailing padding in the padded variant.
        padded_bounds = [*bounds[:-1], SEQ]
        if pad_cu_seqlens:
            # One shape for every sample: the extra entries are empty sequences at the end.
            assert len(got) == len(padded) == SEQ + 1
            assert got == bounds + [bounds[-1]] * (SEQ + 1 - len(bounds))
            assert padded == padded_bounds + [SEQ] * (SEQ + 1 - len(bounds))
            assert params.max_seqlen_q == params.max_seqlen_kv == SEQ
        else:
            assert got == bounds and padded == padded_bounds
            longest = max(b - a for a, b in itertools.pairwise(padded_bounds))
            assert params.max_seqlen_q == params.max_seqlen_kv == longest
    assert max(len(b) for b in dataset.bins) >= 4  # several examples per sequence
    assert any(sum(len(dataset.examples[i][0]) - 1 for i in b) < SEQ for b in dataset.bins)


def test_packed_seq_params_refuses_batches_it_cannot_describe(tmp_path: Path) -> None:
    dataset = _packed(tmp_path, False)
    two = torch.utils.data.default_collate([dataset[0], dataset[1]])
    with pytest.raises(ValueError, match="micro_batch_size=1"):
        build_params(two)
    unpacked = {k: v for k, v in _collate(dataset[0]).items() if k != "cu_seqlens"}
    with pytest.raises(ValueError, match="cu_seqlens"):
        build_params(unpacked)


class _RecordingModel(torch.nn.Module):
    """Stands in for a GPT model of a given layer spec: records what the forward step passes."""

    def __init__(self, backend: str) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.config = type("Config", (), {"resolved_layer_spec_backend": lambda _: backend})()
        self.calls: list[dict[str, Any]] = []

    def forward(self, tokens: Any, position_ids: Any, attention_mask: Any, **kwargs: Any) -> Any:
        self.calls.append({"attention_mask": attention_mask, **kwargs})
        return torch.zeros(tokens.shape)


def test_forward_step_hands_packed_seq_params_to_transformer_engine_only(tmp_path: Path) -> None:
    dataset = _packed(tmp_path, False)
    batch = _collate(dataset[0])
    te, portable = _RecordingModel("transformer_engine"), _RecordingModel("portable")
    forward_step(None, iter([batch]), te)
    forward_step(None, iter([batch]), portable)
    (te_call,), (portable_call,) = te.calls, portable.calls
    params = te_call["packed_seq_params"]
    assert params.cu_seqlens_q.tolist() == build_params(batch).cu_seqlens_q.tolist()
    assert te_call["attention_mask"] is None  # TE confines attention through cu_seqlens
    assert "packed_seq_params" not in portable_call
    assert torch.equal(portable_call["attention_mask"], batch["attention_mask"])
    # An unpacked batch gives TE no packed parameters.
    plain = {k: v for k, v in batch.items() if k not in ("cu_seqlens", "attention_mask")}
    forward_step(None, iter([plain]), te)
    assert "packed_seq_params" not in te.calls[-1]


def _finetuning_config(tmp_path: Path, **train: Any) -> Any:
    root = write_tiny_sft_task(tmp_path / "data", train=4, valid=1)
    return tiny_config_container(
        train=tiny_train_config(**train),
        model=tiny_gpt_provider(vocab_size=258, seq_length=SEQ),
        dataset=FinetuningDatasetConfig(
            dataset_root=root,
            seq_length=SEQ,
            do_validation=False,
            do_test=False,
            packed_sequence_specs=PackedSequenceSpecs(packed_sequence_size=SEQ),
        ),
    )


def test_packed_launch_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    specs = PackedSequenceSpecs(packed_sequence_size=SEQ)
    # This machine has neither CUDA nor Transformer Engine: refused, naming the field.
    for backend in ("transformer_engine", "local"):
        with pytest.raises(ConfigError, match=r"model\.layer_spec_backend") as caught:
            check_packed_sequence_specs(specs, SEQ, tiny_gpt_provider(layer_spec_backend=backend))
        assert "\n" not in str(caught.value)
    # megatron's local attention reads neither the mask nor PackedSeqParams.
    local = tiny_gpt_provider()
    monkeypatch.setattr(local, "resolved_layer_spec_backend", lambda: "local")
    with pytest.raises(ConfigError, match="bridge-train\\[te\\]"):
        check_packed_sequence_specs(specs, SEQ, local)
    # Hybrid Mamba: the mask reaches attention layers only; SSM state would cross examples.
    hybrid = MambaProvider(
        num_layers=2, hybrid_override_pattern="M*", hidden_size=32, seq_length=SEQ, vocab_size=258
    )
    with pytest.raises(ConfigError, match="hybrid Mamba"):
        check_packed_sequence_specs(specs, SEQ, hybrid)
    # The portable spec reads the mask, not cu_seqlens: pad_cu_seqlens would do nothing.
    padded_specs = PackedSequenceSpecs(packed_sequence_size=SEQ, pad_cu_seqlens=True)
    with pytest.raises(ConfigError, match=r"packed_sequence_specs\.pad_cu_seqlens"):
        check_packed_sequence_specs(padded_specs, SEQ, tiny_gpt_provider())
    # Where Transformer Engine resolves (a GPU machine with the te extra): one packed
    # sequence per micro-batch (the dataset section's own rule), no context parallelism.
    config = _finetuning_config(tmp_path, micro_batch_size=2, global_batch_size=4)
    monkeypatch.setattr(config.model, "resolved_layer_spec_backend", lambda: "transformer_engine")
    with pytest.raises(ConfigError, match=r"train\.micro_batch_size"):
        config.validate(1)
    config.train.micro_batch_size = 1
    check_section(vars(config), "dataset", 1)
    config.dataset.packed_sequence_specs.pad_cu_seqlens = True  # read by TE
    check_section(vars(config), "dataset", 1)
    config.model.context_parallel_size = 2
    with pytest.raises(ConfigError, match=r"model\.context_parallel_size"):
        check_section(vars(config), "dataset", 1)
