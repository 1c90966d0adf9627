"""bridge.config with real megatron-core configs (needs megatron-core; runs in the integration venv).

A ``ConfigContainer`` holding megatron's ``TransformerConfig`` (through a model-provider
style subclass), ``OptimizerConfig`` and ``DistributedDataParallelConfig`` validates,
round-trips through YAML and takes dotted overrides; megatron's ``GPTDatasetConfig`` and
``DistributedDataParallelConfig`` can be built from bridge.config's sections field by field.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig as MegatronGPTDatasetConfig
from megatron.core.distributed import DistributedDataParallelConfig as MegatronDDPConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnBackend

import bridge.config as bc
from bridge.config import (
    CheckpointConfig,
    ConfigContainer,
    ConfigError,
    GPTDatasetConfig,
    LoggerConfig,
    MockGPTDatasetConfig,
    SchedulerConfig,
    TokenizerConfig,
    TrainingConfig,
    apply_overrides,
    convert_dataclass,
    load_config,
)

# megatron GPTDatasetConfig init fields bridge's GPTDatasetConfig deliberately does not hold:
# the tokenizer is a runtime object the trainer builds from the `tokenizer` section.
NOT_MIRRORED = {"tokenizer"}


@dataclasses.dataclass
class TinyGPTProvider(TransformerConfig):
    """A model-provider style config: megatron's TransformerConfig plus sequence and vocab."""

    seq_length: int = 64
    vocab_size: int = 256


def _model(**overrides: object) -> TinyGPTProvider:
    values: dict[str, object] = {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "use_cpu_initialization": True,
        "seq_length": 64,
        "vocab_size": 256,
    }
    values.update(overrides)
    return TinyGPTProvider(**values)  # type: ignore[arg-type]


def _container(**sections: object) -> ConfigContainer:
    values: dict[str, object] = {
        "train": TrainingConfig(micro_batch_size=2, global_batch_size=8, train_iters=20),
        "model": _model(),
        "optimizer": OptimizerConfig(lr=3e-4, min_lr=3e-5, weight_decay=0.1),
        "ddp": MegatronDDPConfig(grad_reduce_in_fp32=True),
        "scheduler": SchedulerConfig(lr_warmup_iters=4, lr_decay_style="cosine"),
        "dataset": MockGPTDatasetConfig(
            random_seed=7,
            sequence_length=64,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            num_workers=0,
        ),
        "logger": LoggerConfig(log_interval=5),
        "tokenizer": TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=256),
        "checkpoint": CheckpointConfig(save="/tmp/ckpt", save_interval=10),
    }
    values.update(sections)
    return ConfigContainer(**values)  # type: ignore[arg-type]


def test_container_with_megatron_configs_validates() -> None:
    cfg = _container()
    assert isinstance(cfg.model, bc.ModelConfigProtocol)
    assert isinstance(cfg.optimizer, bc.OptimizerConfigProtocol)
    assert isinstance(cfg.ddp, bc.DDPConfigProtocol)
    cfg.validate(world_size=2)
    assert cfg.data_parallel_size == 2
    assert cfg.scheduler is not None
    assert cfg.scheduler.lr_decay_iters == 20
    assert cfg.scheduler.lr_decay_steps == 20 * 8
    assert cfg.scheduler.lr_warmup_steps == 4 * 8
    cfg.validate(world_size=2)  # idempotent
    assert cfg.scheduler.lr_decay_steps == 160

    with pytest.raises(
        ConfigError, match=r"world size 3 is not divisible by tensor_model_parallel_size \(2\)"
    ):
        _container(model=_model(tensor_model_parallel_size=2)).validate(world_size=3)
    with pytest.raises(
        ConfigError, match=r"dataset.sequence_length: got 64 but model.seq_length is 128"
    ):
        _container(model=_model(seq_length=128)).validate(world_size=1)
    with pytest.raises(ConfigError, match=r"optimizer.bf16=False.*model.bf16=True"):
        _container(model=_model(bf16=True)).validate(world_size=1)
    with pytest.raises(ConfigError, match=r"ddp.use_distributed_optimizer: got True"):
        _container(ddp=MegatronDDPConfig(use_distributed_optimizer=True)).validate(world_size=1)


def test_plain_transformer_config_lacks_seq_length_and_is_refused() -> None:
    plain = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4)
    with pytest.raises(
        ConfigError,
        match=r"model: TransformerConfig does not provide ModelConfigProtocol: it lacks seq_length",
    ):
        _container(model=plain)


def test_yaml_round_trip_of_megatron_objects(tmp_path: Path) -> None:
    cfg = _container(
        model=_model(bf16=True, params_dtype=torch.bfloat16, attention_backend=AttnBackend.local)
    )
    cfg.optimizer.bf16 = True  # type: ignore[union-attr]
    cfg.validate(world_size=1)
    path = tmp_path / "run.yaml"
    cfg.to_yaml(path)
    text = path.read_text()
    assert (
        "_target_: tests.test_config_megatron.TinyGPTProvider" in text or "TinyGPTProvider" in text
    )
    assert "_target_: megatron.core.optimizer.OptimizerConfig" in text
    assert "_target_: megatron.core.distributed.DistributedDataParallelConfig" in text
    assert "_dtype_: torch.bfloat16" in text
    assert "_enum_: megatron.core.transformer.enums.AttnBackend.local" in text

    loaded = ConfigContainer.from_yaml(path)
    assert type(loaded.model) is TinyGPTProvider
    assert type(loaded.optimizer) is OptimizerConfig
    assert type(loaded.ddp) is MegatronDDPConfig
    assert loaded.model.params_dtype is torch.bfloat16
    assert loaded.model.attention_backend is AttnBackend.local
    # Callables survive: a builtin activation and init-method partials.
    assert loaded.model.activation_func is cfg.model.activation_func  # type: ignore[union-attr]
    init = loaded.model.init_method
    assert isinstance(init, functools.partial)
    assert init.func is torch.nn.init.normal_
    assert init.keywords == cfg.model.init_method.keywords  # type: ignore[union-attr]
    # functools.partial compares by identity, so compare the plain-data forms; the YAML
    # written from the loaded config is byte-identical.
    assert loaded.to_dict() == cfg.to_dict()
    again = tmp_path / "again.yaml"
    loaded.to_yaml(again)
    assert again.read_text() == text
    assert loaded.optimizer == cfg.optimizer
    assert loaded.ddp == cfg.ddp
    loaded.validate(world_size=1)


def test_overrides_on_megatron_objects(tmp_path: Path) -> None:
    cfg = _container()
    changed = apply_overrides(
        cfg,
        [
            "model.num_layers=4",
            "optimizer.lr=1e-4",
            "model.params_dtype=bfloat16",
            "ddp.overlap_grad_reduce=true",
        ],
    )
    assert changed.model.num_layers == 4  # type: ignore[union-attr]
    assert changed.optimizer.lr == pytest.approx(1e-4)  # type: ignore[union-attr]
    assert changed.model.params_dtype is torch.bfloat16  # type: ignore[union-attr]
    assert changed.ddp.overlap_grad_reduce is True
    assert cfg.model.num_layers == 2  # type: ignore[union-attr]
    with pytest.raises(
        ConfigError, match=r"model.num_layers: got 'abc' \(str\); expected an integer"
    ):
        apply_overrides(cfg, ["model.num_layers=abc"])
    with pytest.raises(
        ConfigError,
        match=r"model.num_layayers: unknown field of TinyGPTProvider. Did you mean 'num_layers'",
    ):
        apply_overrides(cfg, ["model.num_layayers=4"])

    path = tmp_path / "recipe.yaml"
    cfg.to_yaml(path)
    loaded = load_config(path, ["train.train_iters=100", "optimizer.lr=3e-4", "model.num_layers=4"])
    assert loaded.train is not None and loaded.train.train_iters == 100
    assert loaded.model.num_layers == 4  # type: ignore[union-attr]
    loaded.validate(world_size=1)


def test_every_megatron_gpt_dataset_field_exists_on_bridge() -> None:
    megatron_fields = {f.name for f in dataclasses.fields(MegatronGPTDatasetConfig) if f.init}
    bridge_fields = {f.name for f in dataclasses.fields(GPTDatasetConfig)}
    assert megatron_fields - bridge_fields == NOT_MIRRORED
    # Defaults agree, so a bridge config left at its defaults means what megatron means.
    for f in dataclasses.fields(MegatronGPTDatasetConfig):
        if f.init and f.name in bridge_fields and f.default is not dataclasses.MISSING:
            assert GPTDatasetConfig.__dataclass_fields__[f.name].default == f.default, f.name


def test_megatron_gpt_dataset_config_built_from_bridge() -> None:
    tokenizer = NullTokenizer(vocab_size=256)
    mock = MockGPTDatasetConfig(
        random_seed=7,
        sequence_length=64,
        reset_position_ids=True,
        reset_attention_mask=False,
        eod_mask_loss=True,
    )
    built = convert_dataclass(mock, MegatronGPTDatasetConfig, tokenizer=tokenizer)
    assert built.mock is True and built.split == "1,1,1"
    assert built.sequence_length == 64 and built.random_seed == 7
    assert built.reset_position_ids is True and built.eod_mask_loss is True
    assert built.tokenizer is tokenizer

    real = GPTDatasetConfig(
        random_seed=1,
        sequence_length=32,
        blend=(["/data/a", "/data/b"], [0.25, 0.75]),
        split="98,1,1",
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache="/tmp/cache",
    )
    built = convert_dataclass(real, MegatronGPTDatasetConfig, tokenizer=tokenizer)
    assert built.mock is False
    assert built.blend == (["/data/a", "/data/b"], [0.25, 0.75])
    assert built.split_matrix == [(0, 0.98), (0.98, 0.99), (0.99, 1.0)]
    assert built.path_to_cache == "/tmp/cache"


def test_local_ddp_config_mirrors_megatron() -> None:
    megatron_fields = {f.name: f for f in dataclasses.fields(MegatronDDPConfig)}
    for f in dataclasses.fields(bc.DistributedDataParallelConfig):
        assert f.name in megatron_fields, f.name
        assert f.default == megatron_fields[f.name].default, f.name
    local = bc.DistributedDataParallelConfig(grad_reduce_in_fp32=True, bucket_size=1000)
    built = convert_dataclass(local, MegatronDDPConfig)
    assert built.grad_reduce_in_fp32 is True and built.bucket_size == 1000


def test_expert_parallel_layout_of_a_megatron_moe_config() -> None:
    """DP stays world / (TP x PP x CP); the expert layout must fit the world and the experts."""
    moe = _model(num_moe_experts=8, expert_model_parallel_size=2, moe_ffn_hidden_size=128)
    assert moe.expert_tensor_parallel_size == 1  # megatron fills it from the TP size
    cfg = _container(model=moe, train=TrainingConfig(micro_batch_size=2, train_iters=20))
    cfg.validate(world_size=4)
    assert cfg.data_parallel_size == 4
    assert cfg.train is not None and cfg.train.global_batch_size == 8

    # megatron accepts 6 experts with EP=4 at construction; the layout check does not.
    uneven = _model(num_moe_experts=6, expert_model_parallel_size=4, moe_ffn_hidden_size=128)
    with pytest.raises(
        ConfigError,
        match=r"^model.expert_model_parallel_size: got 4; num_moe_experts \(6\) is not divisible "
        r"by it; valid expert_model_parallel_size values for 4 ranks: 1, 2$",
    ):
        _container(model=uneven).validate(world_size=4)
    with pytest.raises(
        ConfigError,
        match=r"model.expert_model_parallel_size: got 2; world size 3 is not divisible by "
        r"expert_tensor_parallel_size \(1\) x expert_model_parallel_size \(2\)",
    ):
        _container(model=moe).validate(world_size=3)
    # An override bypasses megatron's own __post_init__ check; validate() still catches it.
    dense = apply_overrides(_container(), ["model.expert_model_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"model.num_moe_experts: is unset"):
        dense.validate(world_size=2)


def test_saved_megatron_run_derives_its_schedule_again(tmp_path: Path) -> None:
    cfg = _container(train=TrainingConfig(micro_batch_size=2, train_iters=20))
    cfg.validate(world_size=2)
    assert cfg.train is not None and cfg.scheduler is not None
    assert (cfg.train.global_batch_size, cfg.scheduler.lr_decay_iters) == (4, 20)
    path = tmp_path / "run.yaml"
    cfg.to_yaml(path)

    loaded = load_config(path, ["train.train_iters=100"])
    loaded.validate(world_size=4)
    assert loaded.train is not None and loaded.scheduler is not None
    assert loaded.train.global_batch_size == 8
    assert loaded.scheduler.lr_decay_iters == 100
    assert loaded.scheduler.lr_decay_steps == 100 * 8
    assert type(loaded.model) is TinyGPTProvider and loaded.optimizer == cfg.optimizer
