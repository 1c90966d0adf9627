"""The ``samples`` section: its own checks, its check against evaluation, overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from bridge.config import ConfigContainer, ConfigError, SamplesConfig, load_config


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"prompts": []}, "SamplesConfig.prompts"),
        ({"prompts": ["a", ""]}, "SamplesConfig.prompts"),
        ({"prompts": ["a"], "max_new_tokens": 0}, "SamplesConfig.max_new_tokens"),
        ({"prompts": ["a"], "every_n_evaluations": 0}, "SamplesConfig.every_n_evaluations"),
        ({"prompts": ["a"], "greedy": False, "temperature": 0.0}, "SamplesConfig.temperature"),
        ({"prompts": ["a"], "greedy": False, "top_p": 1.5}, "SamplesConfig.top_p"),
        ({"prompts": ["a"], "greedy": False, "top_k": 3, "top_p": 0.5}, "top_k and top_p"),
        ({"prompts": ["a"], "temperature": 0.7}, "greedy=true"),
    ],
)
def test_bad_values_name_the_field(values: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        SamplesConfig(**values)


def test_samples_need_evaluation(container: ConfigContainer) -> None:
    assert container.train is not None
    container.samples = SamplesConfig(prompts=["1 2 3"])
    container.train.eval_interval = None
    with pytest.raises(ConfigError, match=r"^samples: .*train.eval_interval"):
        container.validate(world_size=1)
    container.train.eval_interval = 5
    container.train.eval_iters = 1
    container.validate(world_size=1)


def test_overrides_switch_it_on_and_it_round_trips(recipe: Path, tmp_path: Path) -> None:
    cfg = load_config(
        recipe,
        [
            "samples.prompts=['Once upon','1 2']",
            "samples.max_new_tokens=8",
            "train.eval_interval=5",
        ],
    )
    assert cfg.samples == SamplesConfig(prompts=["Once upon", "1 2"], max_new_tokens=8)
    saved = tmp_path / "saved.yaml"
    cfg.to_yaml(saved)
    assert ConfigContainer.from_yaml(saved).samples == cfg.samples
    assert load_config(recipe).samples is None  # off unless configured
