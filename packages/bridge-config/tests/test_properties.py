"""Property: any valid config survives YAML and dict round trips unchanged."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, cast

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import bridge.config as bc
from bridge.config import ConfigContainer, ConfigError
from bridge.config.testing import ExampleModelConfig, ExampleOptimizerConfig

SETTINGS = settings(
    max_examples=40,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# Any text (surrogates cannot be written as UTF-8), with strings that OmegaConf would read as
# interpolations or escapes mixed in. The literal type is spelled out because mypy does not
# carry the call's context through hypothesis' strategy decorators.
SURROGATES: tuple[Literal["Cs"]] = ("Cs",)
text = st.text(st.characters(exclude_categories=SURROGATES), max_size=12) | st.sampled_from(
    ["${model.seq_length}", "\\${x}", "a\\\\${b}", "${", "null", "true", "3e-4", "~", ""]
)
keys = st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True)
plain = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3),
    max_leaves=8,
)


def for_type(tp: Any) -> st.SearchStrategy[Any]:
    """A strategy for values of a field annotation (biased towards plausible values)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return plain
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([for_type(a) for a in args])
    if tp is type(None):
        return st.none()
    if origin is list:
        return st.lists(for_type(args[0]), max_size=3)
    if origin is tuple:
        return st.tuples(*[for_type(a) for a in args])
    if origin is dict:
        return st.dictionaries(keys, for_type(args[1]), max_size=3)
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.integers(-2, 10_000)
    if tp is float:
        return st.floats(-1.0, 1e6, allow_nan=False) | st.sampled_from([0.0, 0.5, 1.0])
    if tp is str:
        return text
    if tp is Path:
        return text.filter(bool).map(Path)
    if dataclasses.is_dataclass(tp):
        return section(cast(type, tp))
    raise AssertionError(f"no strategy for {tp!r}")


@st.composite
def section(draw: st.DrawFn, cls: type) -> Any:
    """A valid instance of a config section: random fields, repaired until the checks pass.

    A field named by a failing check falls back to its default, so almost every draw
    yields a valid section instead of being rejected.
    """
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    required = {
        f.name
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    kwargs = {
        f.name: draw(for_type(hints[f.name]))
        for f in fields
        if f.name in required or draw(st.booleans())
    }
    for _ in range(len(fields) + 1):
        try:
            return cls(**kwargs)
        except ConfigError as exc:
            named = [n for n in kwargs if n in str(exc) and n not in required]
            if not named:
                break
            for name in named:
                del kwargs[name]
    # The required fields themselves were bad: fall back to a minimal valid section.
    minimal = {"random_seed": 1, "sequence_length": 16, "seq_length": 16}
    minimal.update(
        dict.fromkeys(("reset_position_ids", "reset_attention_mask", "eod_mask_loss"), False)
    )
    names = {f.name for f in fields}
    return cls(**{k: v for k, v in minimal.items() if k in names})


OPTIONAL_SECTIONS = {
    "train": bc.TrainingConfig,
    "scheduler": bc.SchedulerConfig,
    "logger": bc.LoggerConfig,
    "tokenizer": bc.TokenizerConfig,
    "checkpoint": bc.CheckpointConfig,
    "ft": bc.FaultToleranceConfig,
    "straggler": bc.StragglerDetectionConfig,
    "nvrx_straggler": bc.NVRxStragglerDetectionConfig,
    "profiling": bc.ProfilingConfig,
}


@st.composite
def containers(draw: st.DrawFn) -> ConfigContainer:
    """A container with random valid sections, random models and derived values set."""
    values: dict[str, Any] = {
        "rng": draw(section(bc.RNGConfig)),
        "rerun_state_machine": draw(section(bc.RerunStateMachineConfig)),
        "dist": draw(section(bc.DistributedInitConfig)),
        "ddp": draw(section(bc.DistributedDataParallelConfig)),
    }
    for name, cls in OPTIONAL_SECTIONS.items():
        values[name] = draw(st.none() | section(cls))
    values["dataset"] = draw(
        st.none()
        | section(bc.GPTDatasetConfig)
        | section(bc.MockGPTDatasetConfig)
        | section(bc.FinetuningDatasetConfig)
    )
    values["model"] = draw(
        st.none()
        | st.builds(
            ExampleModelConfig,
            num_layers=st.integers(1, 64),
            seq_length=st.integers(1, 8192),
            params_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
            bf16=st.booleans(),
        )
    )
    values["optimizer"] = draw(
        st.none()
        | st.builds(ExampleOptimizerConfig, lr=st.none() | st.floats(0, 1), optimizer=text)
    )
    values["mixed_precision"] = draw(st.none() | text)
    cfg = ConfigContainer(**values)
    if cfg.scheduler is not None and draw(st.booleans()):
        for name in ("lr_warmup_steps", "lr_decay_steps", "wd_incr_steps", "wsd_decay_steps"):
            setattr(cfg.scheduler, name, draw(st.none() | st.integers(0, 10**9)))
    cfg.data_parallel_size = draw(st.none() | st.integers(1, 1024))
    return cfg


@SETTINGS
@given(cfg=containers())
def test_yaml_round_trip(tmp_path_factory: Any, cfg: ConfigContainer) -> None:
    path = tmp_path_factory.mktemp("prop") / "config.yaml"
    cfg.to_yaml(path)
    loaded = ConfigContainer.from_yaml(path)
    assert loaded == cfg
    assert loaded.to_dict() == cfg.to_dict()


@settings(SETTINGS, max_examples=25)
@given(cfg=containers())
def test_dict_round_trip(cfg: ConfigContainer) -> None:
    assert ConfigContainer.from_dict(cfg.to_dict()) == cfg


@settings(SETTINGS, max_examples=25)
@given(cfg=containers())
def test_apply_overrides_from_its_own_values_changes_nothing(cfg: ConfigContainer) -> None:
    """Writing every scalar field back through a dotted override is a no-op."""
    overrides = []
    for name in ("train", "logger", "checkpoint", "scheduler"):
        sec = getattr(cfg, name)
        if sec is None:
            continue
        for f in dataclasses.fields(sec):
            value = getattr(sec, f.name)
            if f.init and isinstance(value, (bool, int)) and not hasattr(value, "name"):
                overrides.append(
                    f"{name}.{f.name}={str(value).lower() if isinstance(value, bool) else value}"
                )
    assert bc.apply_overrides(cfg, overrides) == cfg
