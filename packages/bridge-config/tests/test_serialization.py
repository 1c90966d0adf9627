"""Dict and YAML round trips, tagged values, interpolation, overrides, printing and diffing."""

from __future__ import annotations

import dataclasses
import enum
import functools
import io
import math
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import bridge.config as bc
from bridge.config import (
    ConfigContainer,
    ConfigError,
    apply_overrides,
    convert_dataclass,
    describe_fields,
    flatten_config,
    format_diff,
    load_config,
    parse_overrides,
)
from bridge.config.testing import ExampleModelConfig, tiny_container


class Activation(enum.Enum):
    """An enum a model config might hold."""

    GELU = "gelu"
    SWIGLU = "swiglu"


def scaled_init(tensor: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """An init function referenced by import path."""
    return tensor.mul_(scale)


@dataclasses.dataclass(kw_only=True)
class RichModelConfig(ExampleModelConfig):
    """A model config with enum, callable, partial and tuple fields."""

    activation: Activation = Activation.GELU
    activation_func: Callable[..., Any] = torch.nn.functional.gelu
    init_method: Callable[..., Any] | None = None
    layer_pattern: tuple[int, ...] = (1, 2)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


def test_dict_round_trip(container: ConfigContainer) -> None:
    assert ConfigContainer.from_dict(container.to_dict()) == container
    container.validate(world_size=2)
    rebuilt = ConfigContainer.from_dict(container.to_dict())
    # What validate() filled in comes back unset and is derived again.
    assert rebuilt.scheduler is not None and rebuilt.scheduler.lr_decay_steps is None
    assert rebuilt.train is not None and rebuilt.train.global_batch_size is None
    assert rebuilt.data_parallel_size is None
    rebuilt.validate(world_size=2)
    assert rebuilt == container
    assert rebuilt.scheduler.lr_decay_steps == 40 and rebuilt.data_parallel_size == 2


def test_yaml_round_trip_is_exact(container: ConfigContainer, tmp_path: Path) -> None:
    container.validate(world_size=2)
    path = tmp_path / "run.yaml"
    container.to_yaml(path)
    loaded = ConfigContainer.from_yaml(path)
    loaded.validate(world_size=2)  # derives again what the first validate() filled in
    assert loaded == container
    assert type(loaded.dataset) is bc.MockGPTDatasetConfig
    assert loaded.train is not None and loaded.train.exit_signal is signal.SIGTERM
    assert loaded.model.params_dtype is torch.float32  # type: ignore[union-attr]
    again = tmp_path / "again.yaml"
    loaded.to_yaml(again)
    assert again.read_text() == path.read_text()


def test_yaml_shows_targets_and_tags(container: ConfigContainer) -> None:
    text = container.format_yaml()
    data = yaml.safe_load(text)
    assert data["_target_"] == "bridge.config.ConfigContainer"
    assert data["train"]["_target_"] == "bridge.config.TrainingConfig"
    assert data["model"]["_target_"] == "bridge.config.testing.ExampleModelConfig"
    assert data["model"]["params_dtype"] == {"_dtype_": "torch.float32"}
    assert data["train"]["exit_signal"] == {"_enum_": "signal.Signals.SIGTERM"}
    out = io.StringIO()
    container.print_yaml(out)
    assert out.getvalue() == text


def test_enums_callables_partials_and_tuples_round_trip(tmp_path: Path) -> None:
    model = RichModelConfig(
        activation=Activation.SWIGLU,
        init_method=functools.partial(scaled_init, scale=0.5),
        layer_pattern=(3, 1, 4),
        extra={"fn": torch.nn.init.zeros_, "cls": torch.nn.Linear, "nested": [{"a": 1.5}]},
    )
    cfg = tiny_container(model=model)
    path = tmp_path / "rich.yaml"
    cfg.to_yaml(path)
    data = yaml.safe_load(path.read_text())["model"]
    assert data["activation"] == {"_enum_": f"{Activation.__module__}.Activation.SWIGLU"}
    assert data["init_method"] == {
        "_target_": f"{scaled_init.__module__}.scaled_init",
        "_partial_": True,
        "scale": 0.5,
    }
    assert data["extra"]["fn"] == {"_target_": "torch.nn.init.zeros_", "_call_": False}
    loaded = ConfigContainer.from_yaml(path).model
    assert isinstance(loaded, RichModelConfig)
    assert loaded.activation is Activation.SWIGLU
    assert loaded.activation_func is torch.nn.functional.gelu
    assert loaded.init_method is not None and loaded.init_method.func is scaled_init  # type: ignore[attr-defined]
    assert loaded.init_method.keywords == {"scale": 0.5}  # type: ignore[attr-defined]
    assert loaded.layer_pattern == (3, 1, 4)
    assert loaded.extra["fn"] is torch.nn.init.zeros_ and loaded.extra["cls"] is torch.nn.Linear
    assert ConfigContainer.from_yaml(path).to_dict() == cfg.to_dict()


@dataclasses.dataclass(kw_only=True)
class DerivingModelConfig(ExampleModelConfig):
    """A model config that derives a field in ``__post_init__`` and carries runtime hooks,
    as megatron's ``TransformerConfig`` (and bridge-train's ``GPTModelProvider``) do."""

    ffn_hidden_size: int | None = None
    no_sync_func: Callable[..., Any] | None = None
    timers: Any = None
    step_hook: Callable[..., Any] | None = None
    runtime_fields = ("step_hook",)

    def __post_init__(self) -> None:
        self._derived: dict[str, Any] = {}
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
            self._derived["ffn_hidden_size"] = self.ffn_hidden_size

    @property
    def derived_fields(self) -> frozenset[str]:
        """Derived fields still holding their derived value."""
        return frozenset(k for k, v in self._derived.items() if getattr(self, k) == v)


class _LiveTimers:
    def __call__(self, name: str) -> None:
        return None


def test_runtime_hooks_and_derived_fields_are_left_out_of_saved_configs(tmp_path: Path) -> None:
    model = DerivingModelConfig(hidden_size=64)
    model.no_sync_func = _LiveTimers().__call__  # a bound method: not importable
    model.timers = _LiveTimers()
    model.step_hook = lambda: None  # listed in runtime_fields
    cfg = tiny_container(model=model)
    path = tmp_path / "run.yaml"
    cfg.to_yaml(path)  # would fail on the hooks if they were encoded
    saved = yaml.safe_load(path.read_text())["model"]
    for name in ("no_sync_func", "timers", "step_hook", "ffn_hidden_size"):
        assert name not in saved, name
    loaded = ConfigContainer.from_yaml(path).model
    assert isinstance(loaded, DerivingModelConfig)
    assert loaded.ffn_hidden_size == 256 and loaded.no_sync_func is None
    # The derived field follows an override of what it is derived from.
    data = yaml.safe_load(path.read_text())
    data["model"]["hidden_size"] = 32
    assert ConfigContainer.from_dict(data).model.ffn_hidden_size == 128  # type: ignore[union-attr]
    # A value set explicitly (not derived) is saved.
    explicit = tiny_container(model=DerivingModelConfig(hidden_size=64, ffn_hidden_size=100))
    assert explicit.to_dict()["model"]["ffn_hidden_size"] == 100
    # Printing shows derived values but never the hooks; diffs ignore both.
    printed = yaml.safe_load(cfg.format_yaml())["model"]
    assert printed["ffn_hidden_size"] == 256
    assert "timers" not in printed and "no_sync_func" not in printed
    paths = {d.path for d in cfg.diff_from_defaults()}
    assert "model.ffn_hidden_size" not in paths and "model.timers" not in paths


def test_enum_and_callable_fields_accept_plain_names() -> None:
    changed = apply_overrides(
        tiny_container(model=RichModelConfig()),
        [
            "model.activation=SWIGLU",
            "model.activation_func=torch.nn.functional.silu",
            "model.params_dtype=torch.bfloat16",
        ],
    )
    model = changed.model
    assert isinstance(model, RichModelConfig)
    assert model.activation is Activation.SWIGLU
    assert model.activation_func is torch.nn.functional.silu
    assert model.params_dtype is torch.bfloat16
    with pytest.raises(
        ConfigError,
        match=r"model.activation: got 'SWIGLUE'; expected a member of Activation: GELU, SWIGLU. Did you mean 'SWIGLU'\?",
    ):
        apply_overrides(tiny_container(model=RichModelConfig()), ["model.activation=SWIGLUE"])


@pytest.mark.parametrize(
    "text",
    [
        "run-${USER}",
        "a\\${b}",
        "a\\\\${b}c",
        "${",
        "plain $ {x}",
        "\\",
        "${a}${b}",
        "back\\slash",
        "\x85",
        "a\u2028b",
    ],
)
def test_strings_that_look_like_interpolations_survive_yaml(tmp_path: Path, text: str) -> None:
    cfg = tiny_container(logger=bc.LoggerConfig(wandb_exp_name=text))
    path = tmp_path / "c.yaml"
    cfg.to_yaml(path)
    assert ConfigContainer.from_yaml(path) == cfg


def test_hand_written_recipe_with_interpolation(write_yaml: Callable[..., Path]) -> None:
    path = write_yaml(
        """
        train: {micro_batch_size: 1, train_iters: 50}
        model:
          _target_: bridge.config.testing.ExampleModelConfig
          seq_length: 16
          params_dtype: bfloat16
          bf16: true
        optimizer: {_target_: bridge.config.testing.ExampleOptimizerConfig, lr: 3e-4, bf16: true}
        scheduler: {}
        logger: {}
        checkpoint: {save: /tmp/ckpts}
        dataset:
          random_seed: 5
          sequence_length: ${model.seq_length}
          reset_position_ids: false
          reset_attention_mask: false
          eod_mask_loss: false
        """.replace("\n        ", "\n")
    )
    cfg = ConfigContainer.from_yaml(path)
    assert isinstance(cfg.dataset, bc.GPTDatasetConfig) and cfg.dataset.sequence_length == 16
    assert cfg.dataset.mock is True and cfg.dataset.split == "1,1,1"
    assert cfg.optimizer is not None and cfg.optimizer.lr == pytest.approx(
        3e-4
    )  # YAML's "3e-4" is a string
    assert cfg.model is not None and cfg.model.params_dtype is torch.bfloat16
    cfg.validate(world_size=1)


def test_a_value_refused_after_interpolation_names_its_source(
    write_yaml: Callable[..., Path],
) -> None:
    """The recipe's dataset takes its length from the model: the error says where from."""
    path = write_yaml(
        """
        train: {micro_batch_size: 1, train_iters: 50}
        model: {_target_: bridge.config.testing.ExampleModelConfig, seq_length: 16}
        dataset:
          random_seed: 5
          sequence_length: ${model.seq_length}
          reset_position_ids: false
          reset_attention_mask: false
          eod_mask_loss: false
        """.replace("\n        ", "\n")
    )
    with pytest.raises(bc.ConfigError) as raised:
        bc.load_config(path, ["model.seq_length=0"])
    assert raised.value.location == "dataset.sequence_length"
    assert "got 0" in str(raised.value)
    assert "the value comes from ${model.seq_length}: change that instead" in str(raised.value)
    # The same file saved with the value: from_yaml names it too.
    path.write_text(path.read_text().replace("seq_length: 16", "seq_length: -3"))
    with pytest.raises(bc.ConfigError, match=r"comes from \$\{model.seq_length\}"):
        ConfigContainer.from_yaml(path)
    # A value written directly is reported as before, with no source.
    path.write_text(path.read_text().replace("${model.seq_length}", "0"))
    with pytest.raises(bc.ConfigError) as raised:
        ConfigContainer.from_yaml(path)
    assert "comes from" not in str(raised.value)


def test_dataset_class_inferred_from_keys(write_yaml: Callable[..., Path]) -> None:
    path = write_yaml(
        {
            "dataset": {
                "seq_length": 64,
                "dataset_root": "/data/sft",
                "packed_sequence_specs": {"packed_sequence_size": 128},
            }
        }
    )
    dataset = ConfigContainer.from_yaml(path).dataset
    assert isinstance(dataset, bc.FinetuningDatasetConfig)
    assert dataset.dataset_root == Path("/data/sft")
    assert dataset.packed_sequence_specs == bc.PackedSequenceSpecs(packed_sequence_size=128)


def test_values_are_normalised_like_yaml() -> None:
    dataset = bc.GPTDatasetConfig(
        random_seed=1,
        sequence_length=8,
        blend=[["a", "b"], [1, 3]],  # type: ignore[arg-type]
        split="9,1",
        reset_position_ids=True,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    assert dataset.blend == (["a", "b"], [1, 3])
    assert bc.FinetuningDatasetConfig(seq_length=8, dataset_root="x").dataset_root == Path("x")
    assert bc.CheckpointConfig(save=2024).save == "2024"  # type: ignore[arg-type]
    assert bc.TrainingConfig(exit_signal=10).exit_signal is signal.SIGUSR1


def test_parse_overrides_value_types() -> None:
    parsed = dict(
        parse_overrides(
            [
                "a.int=100",
                "a.float=3e-4",
                "a.bool=true",
                "a.null=null",
                "a.empty=",
                "a.list=[1,2]",
                "a.map={x: 1}",
                "a.quoted='100'",
                "a.path=/tmp/x=y",
                "a.ref=${train.train_iters}",
            ]
        )
    )
    assert parsed == {
        "a.int": 100,
        "a.float": 3e-4,
        "a.bool": True,
        "a.null": None,
        "a.empty": None,
        "a.list": [1, 2],
        "a.map": {"x": 1},
        "a.quoted": "100",
        "a.path": "/tmp/x=y",
        "a.ref": "${train.train_iters}",
    }


def test_apply_overrides_returns_a_new_container(container: ConfigContainer) -> None:
    changed = apply_overrides(
        container,
        [
            "train.train_iters=100",
            "optimizer.lr=3e-4",
            "model.num_layers=4",
            "ft.enable_ft_package=true",
            "checkpoint.save=/tmp/ckpt",
            "logger.modules_to_filter=[a.b, c]",
            "profiling={profile_step_start: 1, profile_step_end: 3}",
            "train.eval_interval=null",
            "dataset.sequence_length=${model.seq_length}",
        ],
    )
    assert changed is not container
    assert (
        changed.train is not None
        and changed.train.train_iters == 100
        and changed.train.eval_interval is None
    )
    assert changed.optimizer.lr == pytest.approx(3e-4)  # type: ignore[union-attr]
    assert changed.model.num_layers == 4  # type: ignore[union-attr]
    assert changed.ft == bc.FaultToleranceConfig(enable_ft_package=True)  # created from defaults
    assert changed.logger is not None and changed.logger.modules_to_filter == ["a.b", "c"]
    assert changed.profiling == bc.ProfilingConfig(profile_step_start=1, profile_step_end=3)
    assert (
        container.train is not None and container.train.train_iters == 10 and container.ft is None
    )
    changed.validate(world_size=1)
    assert changed.scheduler is not None and changed.scheduler.lr_decay_steps == 200


def test_overrides_apply_before_checks_in_load_config(recipe: Path) -> None:
    # Each override alone would fail a check; together they are valid.
    cfg = load_config(recipe, ["checkpoint.async_save=true", "checkpoint.save=/tmp/ckpt"])
    assert cfg.checkpoint is not None and cfg.checkpoint.async_save
    real = load_config(
        recipe,
        [
            "dataset._target_=bridge.config.GPTDatasetConfig",
            "dataset.mock=false",
            "dataset.blend=[[/data/a, /data/b], [0.3, 0.7]]",
            "dataset.split=98,1,1",
            "nvrx_straggler.enabled=true",
        ],
    )
    assert type(real.dataset) is bc.GPTDatasetConfig
    assert real.dataset.blend == (["/data/a", "/data/b"], [0.3, 0.7])
    assert real.nvrx_straggler == bc.NVRxStragglerDetectionConfig(enabled=True)


def test_override_into_a_mapping_field() -> None:
    cfg = tiny_container(dataset=bc.FinetuningDatasetConfig(seq_length=32))
    changed = apply_overrides(
        cfg, ["dataset.dataset_kwargs.prompt=chat", "dataset.dataset_kwargs.max=3"]
    )
    assert changed.dataset.dataset_kwargs == {"prompt": "chat", "max": 3}  # type: ignore[union-attr]


def test_diff_from_defaults(container: ConfigContainer) -> None:
    changed = apply_overrides(container, ["train.train_iters=100", "logger.log_interval=7"])
    diffs = {d.path: (d.default, d.value) for d in changed.diff_from_defaults()}
    assert diffs["train.train_iters"] == (None, 100)
    assert diffs["logger.log_interval"] == (100, 7)
    assert diffs["dataset._target_"] == (None, "bridge.config.MockGPTDatasetConfig")
    assert diffs["dataset.random_seed"] == ("<required>", 1234)
    assert "rng.seed" not in diffs and "logger.log_throughput" not in diffs
    text = format_diff(changed.diff_from_defaults())
    assert "train.train_iters: null -> 100\n" in text
    assert "logger.log_interval: 100 -> 7\n" in text
    assert "dataset._target_: null -> 'bridge.config.MockGPTDatasetConfig'\n" in text
    assert ConfigContainer().diff_from_defaults() == []
    assert format_diff([]) == ""


def test_flatten_config_gives_dotted_paths(container: ConfigContainer) -> None:
    # The one flattening of bridge-train's override report and bridge-logging's run
    # parameters: only mappings are descended into.
    data = {"train": {"lr": 1, "sizes": [1, 2], "none": None}, "empty": {}, "top": "x"}
    assert flatten_config(data) == {
        "train.lr": 1,
        "train.sizes": [1, 2],
        "train.none": None,
        "top": "x",
    }
    assert flatten_config({"lr": 1}, "train") == {"train.lr": 1}
    flat = flatten_config(yaml.safe_load(container.format_yaml()))
    assert flat["train.micro_batch_size"] == container.train.micro_batch_size  # type: ignore[union-attr]


def test_convert_dataclass() -> None:
    @dataclasses.dataclass
    class Target:
        num_workers: int
        pin_memory: bool = False
        tokenizer: Any = None

    source = bc.DataloaderConfig(num_workers=3)
    built = convert_dataclass(source, Target, tokenizer="tok")
    assert built == Target(num_workers=3, pin_memory=True, tokenizer="tok")
    with pytest.raises(ConfigError, match=r"tokenzier is not an init field"):
        convert_dataclass(source, Target, tokenzier="tok")
    with pytest.raises(
        ConfigError, match=r"Target\.num_workers: required, but RNGConfig has no 'num_workers'"
    ):
        convert_dataclass(bc.RNGConfig(), Target)


def test_describe_fields() -> None:
    info = {f.name: f for f in describe_fields(bc.TrainingConfig)}
    assert info["micro_batch_size"].type == "Optional[int]"
    assert info["micro_batch_size"].default == "None"
    assert info["engine"].type == "Optional[Literal['portable', 'megatron']]"
    assert info["exit_signal"].default == "Signals.SIGTERM"
    assert "Deprecated" in info["engine"].doc
    steps = {f.name: f for f in describe_fields(bc.SchedulerConfig)}["lr_decay_steps"]
    assert not steps.settable
    local_rank = {f.name: f for f in describe_fields(bc.DistributedInitConfig)}["local_rank"]
    assert local_rank.default == "$LOCAL_RANK, else $SLURM_LOCALID, else 0"
    with pytest.raises(TypeError):
        describe_fields(int)


def test_parse_split() -> None:
    assert bc.parse_split("99,1,0") == pytest.approx([0.99, 0.01, 0.0])
    assert bc.parse_split("1/1") == pytest.approx([0.5, 0.5, 0.0])
    with pytest.raises(ValueError):
        bc.parse_split("1,2,3,4")


def test_special_floats_round_trip(tmp_path: Path) -> None:
    cfg = tiny_container(
        dataset=bc.FinetuningDatasetConfig(
            seq_length=32, dataset_kwargs={"cap": math.inf, "low": -0.0}
        )
    )
    path = tmp_path / "f.yaml"
    cfg.to_yaml(path)
    assert ConfigContainer.from_yaml(path) == cfg


def test_a_config_naming_a_moved_module_still_loads(
    container: ConfigContainer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A saved config keeps loading after the class it names moved to another module."""
    from bridge.config import _codec

    monkeypatch.setattr(_codec, "_MOVED_IMPORTS", {})
    data = container.to_dict()
    current = data["model"]["_target_"]
    module, _, name = current.rpartition(".")
    data["model"]["_target_"] = f"old_home.for_{name.lower()}.{name}"
    with pytest.raises(ConfigError, match="old_home"):
        ConfigContainer.from_dict(data)
    bc.register_moved_import(f"old_home.for_{name.lower()}", module)
    loaded = ConfigContainer.from_dict(data)
    assert loaded == container
    # Saving writes where the class lives now.
    assert loaded.to_dict()["model"]["_target_"] == current
