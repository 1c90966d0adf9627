"""ConfigContainer.validate(): derived values and cross-section behaviour on valid configs."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

import bridge.config as bc
from bridge.config import ConfigContainer, ConfigError, resolve_world_size
from bridge.config.testing import (
    ExampleCommOverlapConfig,
    ExampleModelConfig,
    ExampleOptimizerConfig,
    tiny_container,
)
from core_utils.testing import run_distributed


@dataclass
class MixedPrecision:
    """A bf16 mixed-precision recipe."""

    bf16: bool = True
    fp16: bool = False
    params_dtype: str = "bfloat16"


def test_fills_data_parallel_size_global_batch_and_scheduler_steps(
    container: ConfigContainer,
) -> None:
    container.validate(world_size=4)
    assert container.data_parallel_size == 4
    assert container.train is not None and container.scheduler is not None
    assert container.train.global_batch_size == 2 * 4  # micro batch x data-parallel size
    assert container.scheduler.lr_decay_iters == 10  # defaults to train_iters
    assert container.scheduler.lr_decay_steps == 10 * 8  # counted in samples
    assert container.scheduler.wd_incr_steps == 10 * 8
    assert container.scheduler.lr_warmup_steps == 2 * 8
    assert container.scheduler.wsd_decay_steps is None


def test_validate_is_idempotent(container: ConfigContainer) -> None:
    container.validate(world_size=2)
    first = container.to_dict()
    container.validate(world_size=2)
    assert container.to_dict() == first


def test_model_parallel_sizes_divide_the_world() -> None:
    model = ExampleModelConfig(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=2
    )
    cfg = tiny_container(model=model, train=bc.TrainingConfig(micro_batch_size=1, train_iters=10))
    assert cfg.get_data_parallel_size(16) == 2
    cfg.validate(world_size=16)
    assert cfg.data_parallel_size == 2
    assert cfg.train is not None and cfg.train.global_batch_size == 2


def test_explicit_global_batch_size_is_kept_and_gives_microbatches() -> None:
    cfg = tiny_container(
        train=bc.TrainingConfig(micro_batch_size=2, global_batch_size=16, train_iters=10)
    )
    cfg.validate(world_size=2)
    assert cfg.train is not None and cfg.train.global_batch_size == 16
    assert cfg.scheduler is not None and cfg.scheduler.lr_decay_steps == 160


def test_decrease_batch_size_if_needed_allows_a_non_multiple() -> None:
    train = bc.TrainingConfig(
        micro_batch_size=2, global_batch_size=10, train_iters=10, decrease_batch_size_if_needed=True
    )
    cfg = tiny_container(train=train)
    cfg.validate(world_size=2)
    assert cfg.train is not None and cfg.train.global_batch_size == 10


def test_warmup_fraction_and_wsd_and_weight_decay_schedule() -> None:
    scheduler = bc.SchedulerConfig(
        lr_decay_style="WSD",
        lr_wsd_decay_iters=4,
        lr_warmup_fraction=0.25,
        lr_decay_iters=8,
        start_weight_decay=0.0,
        end_weight_decay=0.1,
        weight_decay_incr_style="cosine",
    )
    cfg = tiny_container(scheduler=scheduler)
    cfg.validate(world_size=1)
    assert (scheduler.lr_decay_steps, scheduler.lr_warmup_steps) == (16, 4)
    assert scheduler.wsd_decay_steps == 8
    assert scheduler.wd_incr_steps == 20


def test_sample_based_training() -> None:
    train = bc.TrainingConfig(
        micro_batch_size=2, global_batch_size=8, train_samples=800, rampup_batch_size=[4, 4, 200]
    )
    scheduler = bc.SchedulerConfig(
        lr_warmup_samples=80, lr_decay_style="WSD", lr_wsd_decay_samples=100
    )
    cfg = tiny_container(train=train, scheduler=scheduler)
    cfg.validate(world_size=2)
    assert scheduler.lr_decay_samples == 800
    assert (scheduler.lr_decay_steps, scheduler.lr_warmup_steps, scheduler.wd_incr_steps) == (
        800,
        80,
        800,
    )
    assert scheduler.wsd_decay_steps == 100

    fraction = bc.SchedulerConfig(lr_warmup_fraction=0.1, lr_decay_samples=500)
    cfg = tiny_container(
        train=bc.TrainingConfig(micro_batch_size=2, train_samples=1000), scheduler=fraction
    )
    cfg.validate(world_size=1)
    assert (fraction.lr_decay_steps, fraction.lr_warmup_steps, fraction.wd_incr_steps) == (
        500,
        50,
        1000,
    )


def test_skip_train_needs_no_length() -> None:
    cfg = tiny_container(train=bc.TrainingConfig(micro_batch_size=1, skip_train=True))
    cfg.validate(world_size=1)
    assert cfg.scheduler is not None and cfg.scheduler.lr_decay_steps is None


def test_comm_overlap_gets_the_data_parallel_size_then_sets_up_the_sections() -> None:
    overlap = ExampleCommOverlapConfig()
    cfg = tiny_container(comm_overlap=overlap)
    cfg.validate(world_size=2)
    assert overlap.data_parallel_size == 2
    assert overlap.setup_calls == [(cfg.model, cfg.optimizer, cfg.ddp)]


def test_comm_overlap_without_setup_is_refused() -> None:
    @dataclass
    class NoSetup:
        tp_comm_overlap: bool = False
        data_parallel_size: int | None = None

    with pytest.raises(ConfigError, match="it lacks setup"):
        tiny_container(comm_overlap=NoSetup())


def test_matching_mixed_precision_and_half_precision_flags_pass() -> None:
    model = ExampleModelConfig(bf16=True)
    tiny_container(model=model, mixed_precision=MixedPrecision()).validate(world_size=1)
    tiny_container(model=model, mixed_precision="bf16_mixed").validate(world_size=1)
    tiny_container(mixed_precision="fp16_mixed").validate(world_size=1)  # the recipe sets the flags
    tiny_container(model=model, optimizer=ExampleOptimizerConfig(bf16=True)).validate(world_size=1)


def test_byte_level_tokenizer_vocab_and_padding() -> None:
    tokenizer = bc.TokenizerConfig(
        tokenizer_type="ByteLevelTokenizer", special_tokens=["<eod>", "<pad>"]
    )
    assert tokenizer.total_vocab_size() == 258
    assert tokenizer.padded_vocab_size(tensor_model_parallel_size=2) == 512
    assert bc.TokenizerConfig().padded_vocab_size() is None
    cfg = tiny_container(tokenizer=tokenizer, model=ExampleModelConfig(vocab_size=512))
    cfg.validate(world_size=1)


def test_byte_level_total_vocab_matches_the_tokenizer() -> None:
    """<eod> and <pad> always exist; extra ids and other specials add to them."""
    assert bc.TokenizerConfig(tokenizer_type="ByteLevelTokenizer").total_vocab_size() == 258
    with_specials = bc.TokenizerConfig(
        tokenizer_type="ByteLevelTokenizer", special_tokens=["<bos>", "<eod>"], vocab_extra_ids=3
    )
    assert with_specials.total_vocab_size() == 256 + 3 + 3  # <bos>, <eod>, <pad> + 3 extra ids
    sized = bc.TokenizerConfig(tokenizer_type="ByteLevelTokenizer", vocab_size=300)
    assert sized.total_vocab_size() == 300  # vocab_size already includes the specials
    assert (
        bc.TokenizerConfig(
            tokenizer_type="NullTokenizer", vocab_size=10, vocab_extra_ids=2
        ).total_vocab_size()
        == 12
    )
    with pytest.raises(bc.ConfigError, match="at least 259 ids") as info:
        bc.TokenizerConfig(tokenizer_type="ByteLevelTokenizer", vocab_size=258, vocab_extra_ids=1)
    assert "vocab_size" in str(info.value)
    small_model = tiny_container(
        tokenizer=bc.TokenizerConfig(tokenizer_type="ByteLevelTokenizer"),
        model=ExampleModelConfig(vocab_size=257),
    )
    with pytest.raises(bc.ConfigError, match="emits 258 ids"):
        small_model.validate(world_size=1)


@dataclass
class OtherTokenizerConfig:
    """A tokenizer config of another package with the fields of bridge.config's (no methods)."""

    tokenizer_type: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None
    vocab_extra_ids: int = 0
    special_tokens: list[str] | None = None


@dataclass
class TokenizerWithoutExtraIds:
    """Lacks ``vocab_extra_ids``, so it does not provide TokenizerConfigProtocol."""

    tokenizer_type: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None


def test_tokenizer_section_accepts_another_class_with_the_same_fields(tmp_path: Path) -> None:
    other = OtherTokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=100, vocab_extra_ids=4)
    assert isinstance(other, bc.TokenizerConfigProtocol)
    cfg = tiny_container(tokenizer=other)
    assert cfg.tokenizer is other
    cfg.validate(world_size=1)  # 104 ids fit the model's 128

    path = tmp_path / "run.yaml"
    cfg.to_yaml(path)
    loaded = ConfigContainer.from_yaml(path)
    assert type(loaded.tokenizer) is OtherTokenizerConfig and loaded.tokenizer == other

    too_many = tiny_container(
        tokenizer=OtherTokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=200)
    )
    with pytest.raises(bc.ConfigError, match=r"tokenizer.vocab_size: the tokenizer emits 200 ids"):
        too_many.validate(world_size=1)
    # A byte-level tokenizer's size comes from its special tokens, read when present.
    byte_level = OtherTokenizerConfig(tokenizer_type="ByteLevelTokenizer", special_tokens=["<bos>"])
    assert (
        bc.TokenizerConfig(
            tokenizer_type="ByteLevelTokenizer", special_tokens=["<bos>"]
        ).total_vocab_size()
        == 259
    )
    with pytest.raises(bc.ConfigError, match=r"emits 259 ids"):
        tiny_container(tokenizer=byte_level).validate(world_size=1)
    tiny_container(tokenizer=byte_level, model=ExampleModelConfig(vocab_size=512)).validate(
        world_size=1
    )


def test_tokenizer_section_rejects_a_class_without_the_protocol() -> None:
    with pytest.raises(
        bc.ConfigError,
        match=r"ConfigContainer.tokenizer: TokenizerWithoutExtraIds does not provide "
        r"TokenizerConfigProtocol: it lacks vocab_extra_ids",
    ):
        ConfigContainer(tokenizer=TokenizerWithoutExtraIds())  # type: ignore[arg-type]
    target = f"{TokenizerWithoutExtraIds.__module__}.TokenizerWithoutExtraIds"
    with pytest.raises(bc.ConfigError, match=r"tokenizer._target_: .* it lacks vocab_extra_ids"):
        ConfigContainer.from_dict({"tokenizer": {"_target_": target}})
    # Without _target_ a mapping is bridge.config's own TokenizerConfig.
    built = ConfigContainer.from_dict({"tokenizer": {"tokenizer_type": "ByteLevelTokenizer"}})
    assert type(built.tokenizer) is bc.TokenizerConfig


def test_expert_parallelism_keeps_the_data_parallel_size() -> None:
    """DP = world / (TP x PP x CP), as in megatron; the expert layout only has to fit."""
    model = ExampleModelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2)
    cfg = tiny_container(model=model)
    assert cfg.get_data_parallel_size(8) == 4
    cfg.validate(world_size=8)
    assert cfg.data_parallel_size == 4
    assert cfg.train is not None and cfg.train.global_batch_size == 2 * 4


def test_world_size_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert resolve_world_size() == 1
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert resolve_world_size() == 4
    assert resolve_world_size(2) == 2
    cfg = tiny_container()
    cfg.validate()
    assert cfg.data_parallel_size == 4
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(bc.ConfigError, match="WORLD_SIZE: got 'four'"):
        resolve_world_size()


def _validate_in_process_group(rank: int, world_size: int) -> tuple[int, int | None]:
    os.environ.pop("WORLD_SIZE", None)  # the process group alone must give the size
    cfg = tiny_container()
    cfg.validate()
    assert cfg.train is not None
    return cfg.data_parallel_size or 0, cfg.train.global_batch_size


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_world_size_from_torch_distributed() -> None:
    assert run_distributed(_validate_in_process_group, 2, timeout=90) == [(2, 4), (2, 4)]


def test_train_engine_is_a_deprecated_alias_that_warns_once_on_rank_0(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bridge.config import _training

    def run(engine: Literal["portable", "megatron"] | None) -> None:
        cfg = tiny_container(
            train=bc.TrainingConfig(micro_batch_size=1, train_iters=10, engine=engine)
        )
        cfg.validate(1)

    monkeypatch.setattr(_training, "_warned_engine", False)
    monkeypatch.delenv("RANK", raising=False)
    with caplog.at_level(logging.WARNING, logger="bridge.config"):
        run(None)  # unset: no warning
        assert caplog.records == []
        # A saved config read back (a checkpoint's run_config.yaml) is not a run: no warning.
        assert bc.TrainingConfig(engine="portable").engine == "portable"
        assert caplog.records == []
        # Either value is accepted (both train on megatron-core's engine), with one line
        # per process, however often the run validates its config.
        run("portable")
        run("megatron")
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and "\n" not in record.getMessage()
    assert record.getMessage().startswith("train.engine='portable' is deprecated")
    assert "megatron-core's engine is the only engine" in record.getMessage()
    assert "remove train.engine" in record.getMessage()

    caplog.clear()
    monkeypatch.setattr(_training, "_warned_engine", False)
    monkeypatch.setenv("RANK", "1")  # torchrun's other ranks stay quiet
    with caplog.at_level(logging.WARNING, logger="bridge.config"):
        run("megatron")
    assert caplog.records == []
    with pytest.raises(ConfigError, match=r"engine: got 'fast'; expected one of 'portable'"):
        bc.TrainingConfig(engine="fast")  # type: ignore[arg-type]
