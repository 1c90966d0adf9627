"""The one pass of launch checks: every section's rules, one problem per section, for GPT-style
runs and the mimo recipe alike (``checks/registry.py``, ``checks/preflight.py``)."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest

from bridge.config import (
    ConfigContainer,
    ConfigError,
    GPTDatasetConfig,
    LoggerConfig,
    SamplesConfig,
    load_config,
)
from bridge.train.checks.preflight import (
    ConfigProblems,
    check_config_before_launch,
    check_section,
    run_kind,
)
from bridge.train.checks.registry import FACTS, REGISTRY, SECTIONS
from bridge.train.checks.rules import sharp_and_stream_priority_need_nccl
from bridge.train.cli import EXIT_CONFIG_ERROR, main
from bridge.train.recipes import recipe_path
from bridge.train.testing import tiny_config_container, tiny_dist_config, tiny_train_config


def test_every_rule_reads_sections_and_facts_only() -> None:
    fields = {f.name for f in dataclasses.fields(ConfigContainer)}
    assert set(REGISTRY) <= set(SECTIONS) and set(SECTIONS) <= fields
    for section, rules in REGISTRY.items():
        for rule in rules:
            assert set(rule.reads) <= fields | set(FACTS), (section, rule.check)
            # Every rule is named for what it checks and says so in a docstring (the
            # generated "unused by mimo" rules excepted).
            if not rule.check.__name__.endswith("_is_unused"):
                assert inspect.getdoc(rule.check), rule.check


def test_one_problem_per_section_in_one_pass(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cfg = tiny_config_container(logger=LoggerConfig(tensorboard_dir=str(blocker / "tb")))
    assert cfg.checkpoint is not None
    cfg.checkpoint.load = str(tmp_path / "missing")
    cfg.rerun_state_machine.rerun_mode = "validate_results"
    with pytest.raises(ConfigProblems) as info:
        check_config_before_launch(cfg, world_size=1, cuda_available=False)
    problems = [str(p) for p in info.value.problems]
    # In section order; str() of the error is the first one.
    assert [p.split(":")[0] for p in problems] == [
        "rerun_state_machine.rerun_mode",
        "checkpoint.load",
        "logger.tensorboard_dir",
    ]
    assert str(info.value) == problems[0]
    assert "'validate_results' requires CUDA" in problems[0]
    # Fixing the sections one by one leaves the others.
    cfg.rerun_state_machine.rerun_mode = "disabled"
    cfg.checkpoint.load = None
    with pytest.raises(ConfigError, match=r"^logger\.tensorboard_dir: .* cannot be created"):
        check_config_before_launch(cfg, world_size=1, cuda_available=False)
    with pytest.raises(ConfigError, match=r"^logger\.tensorboard_dir: "):
        check_section(vars(cfg), "logger", 1)
    check_section(vars(cfg), "checkpoint", 1)


def test_the_command_prints_every_section_s_problem(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as info:
        main(
            [
                "--dry-run",
                "rerun_state_machine.rerun_mode=validate_results",
                f"checkpoint.load={tmp_path / 'missing'}",
            ]
        )
    assert info.value.code == EXIT_CONFIG_ERROR
    lines = [
        line for line in capsys.readouterr().err.splitlines() if not line.startswith("[bridge-")
    ]
    assert [line.split(":")[2].strip() for line in lines] == [
        "rerun_state_machine.rerun_mode",
        "checkpoint.load",
    ]
    assert all(line.startswith("bridge-train: error: ") for line in lines)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"lazy_init": True},
            "dist.lazy_init: got true; bridge-train sets up data parallelism itself and hands "
            "no finish function to an external DDP manager: set dist.lazy_init=false",
        ),
        (
            {"use_torch_fsdp2": True},
            "dist.use_torch_fsdp2: got true; bridge-train does not shard with torch's FSDP2: "
            "set dist.use_torch_fsdp2=false and shard optimizer state with megatron's "
            "distributed optimizer (ddp.use_distributed_optimizer=true)",
        ),
        (
            {"use_sharp": True},
            "dist.use_sharp: needs NCCL on CUDA, and no GPU is available; set "
            "dist.use_sharp=false (or run on GPUs with dist.distributed_backend='nccl')",
        ),
        (
            {"high_priority_stream_groups": ["dp"]},
            "dist.high_priority_stream_groups: needs NCCL on CUDA, and no GPU is available; "
            "set dist.high_priority_stream_groups=null",
        ),
    ],
)
def test_dist_settings_the_trainer_cannot_honour_here_are_refused(
    overrides: dict[str, object], message: str
) -> None:
    cfg = tiny_config_container(dist=tiny_dist_config(**overrides))
    with pytest.raises(ConfigError) as info:
        check_section(vars(cfg), "dist", 1, cuda_available=False)
    assert str(info.value).startswith(message)


def test_sharp_and_stream_priorities_pass_with_nccl_on_cuda_only() -> None:
    sharp = tiny_dist_config(distributed_backend="nccl", use_sharp=True)
    sharp_and_stream_priority_need_nccl(sharp, cuda_available=True)
    streams = tiny_dist_config(high_priority_stream_groups=["dp"])  # gloo
    with pytest.raises(
        ConfigError, match=r"^dist\.high_priority_stream_groups: .*the backend is gloo"
    ):
        sharp_and_stream_priority_need_nccl(streams, cuda_available=True)
    sharp_and_stream_priority_need_nccl(tiny_dist_config(), cuda_available=False)


def test_the_command_refuses_dist_settings_it_would_ignore(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as info:
        main(
            [
                "--dry-run",
                "dist.distributed_backend=gloo",
                "dist.use_sharp=true",
                "dist.lazy_init=true",
                "dist.use_torch_fsdp2=true",
                "train.train_iters=2",
            ]
        )
    assert info.value.code == EXIT_CONFIG_ERROR
    lines = [
        line for line in capsys.readouterr().err.splitlines() if not line.startswith("[bridge-")
    ]
    # One problem per section: the first of the dist section's rules.
    assert lines == [
        "bridge-train: error: dist.lazy_init: got true; bridge-train sets up data parallelism "
        "itself and hands no finish function to an external DDP manager: set "
        "dist.lazy_init=false"
    ]


def _mimo(*overrides: str) -> ConfigContainer:
    return load_config(recipe_path("mimo"), ["train.train_iters=6", *overrides])


def test_the_rules_main_brought_are_registry_rules() -> None:
    """The split-sample, samples and resume checks run as rules of their sections."""
    names = {
        section: [rule.check.__name__ for rule in rules] for section, rules in REGISTRY.items()
    }
    assert "data_splits_hold_samples" in names["dataset"]
    assert names["samples"] == ["samples_can_be_generated", "samples_is_unused"]
    assert names["checkpoint"][-1] == "resume_matches_run"
    # The mimo recipe has no samples: the section is refused, not ignored.
    cfg = _mimo()
    cfg.samples = SamplesConfig(prompts=["Hello"])
    with pytest.raises(ConfigError, match=r"^samples: is set, but the mimo recipe does not use"):
        check_section(vars(cfg), "samples", world_size=1, cuda_available=False)


def test_the_mimo_recipe_runs_the_same_pass_and_refuses_what_it_ignores(tmp_path: Path) -> None:
    assert run_kind(_mimo().model) == "mimo"
    assert run_kind(tiny_config_container().model) == "gpt"
    check_config_before_launch(_mimo(), world_size=1, cuda_available=False)
    cfg = _mimo("train.check_weight_hash_across_dp_replicas_interval=2")
    cfg.dataset = tiny_config_container().dataset
    cfg.rerun_state_machine.error_injection_rate = 3
    with pytest.raises(ConfigProblems) as info:
        check_config_before_launch(cfg, world_size=1, cuda_available=False)
    assert [str(p) for p in info.value.problems] == [
        "train.check_weight_hash_across_dp_replicas_interval: got 2; the MIMO recipe's modules "
        "have data-parallel groups of their own, which megatron's weight-hash check does not "
        "know: unset it",
        "rerun_state_machine.error_injection_rate: got 3; the MIMO recipe does not run "
        "megatron-core's rerun state machine, which injects these errors: set it to 0",
        "dataset: is set, but the mimo recipe does not use it (it trains its own model on "
        "synthetic data); remove the 'dataset' section",
    ]
    # The general rules of the sections both kinds of run share apply to MIMO too.
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"^checkpoint\.save: .*is a file"):
        check_config_before_launch(
            _mimo(f"checkpoint.save={blocker}"), world_size=1, cuda_available=False
        )
    with pytest.raises(ConfigError, match=r"^profiling\.use_nsys_profiler: "):
        check_config_before_launch(
            _mimo("profiling.use_nsys_profiler=true"), world_size=1, cuda_available=False
        )
    # So do bridge-config's learning-rate rule and its messages (validate() does not run).
    with pytest.raises(ConfigError, match=r"^scheduler\.lr_warmup_init: got 1\.0, above"):
        check_config_before_launch(
            _mimo("scheduler.lr_warmup_init=1.0"), world_size=1, cuda_available=False
        )
    with pytest.raises(ConfigError, match=r"^optimizer\.lr: is required"):
        check_config_before_launch(_mimo("optimizer.lr=null"), world_size=1, cuda_available=False)
    # What the recipe needs, and a rerun mode it does not run, are refused too.
    for overrides, message in [
        (["train.micro_batch_size=null"], r"^train\.global_batch_size: the mimo recipe needs"),
        (["rerun_state_machine.rerun_mode=validate_results"], r"^rerun_state_machine\.rerun_mode"),
    ]:
        with pytest.raises(ConfigError, match=message):
            check_config_before_launch(_mimo(*overrides), world_size=1, cuda_available=False)
    cfg = _mimo()
    cfg.logger = None
    with pytest.raises(ConfigError, match=r"^logger: required section is missing"):
        check_config_before_launch(cfg, world_size=1, cuda_available=False)


def test_a_training_length_whose_dataset_index_cannot_fit_in_memory_is_refused() -> None:
    cfg = tiny_config_container(train=tiny_train_config(train_iters=10**15))
    cfg.validate(1)
    with pytest.raises(ConfigError, match=r"^train\.train_iters: got 10{15}: .* dataset index"):
        check_section(vars(cfg), "train", 1)
    assert cfg.train is not None
    cfg.train.skip_train = True  # evaluation only: no training index is built
    check_section(vars(cfg), "train", 1)


@pytest.mark.parametrize("name", ["multiple_validation_sets", "full_validation"])
def test_separate_validation_sets_of_mock_data_are_refused_not_ignored(name: str) -> None:
    """Mock data has no separate validation sets (and a full pass is over separate sets):
    refused in the one pass, naming the field (test_validation_sets.py runs them)."""
    cfg = tiny_config_container()
    dataset = cfg.dataset
    assert isinstance(dataset, GPTDatasetConfig)
    overrides: dict[str, Any] = {name: True}
    cfg.dataset = dataclasses.replace(dataset, **overrides)
    with pytest.raises(ConfigError) as info:
        check_section(vars(cfg), "dataset", 1, cuda_available=False)
    assert str(info.value).startswith(f"dataset.{name}: got true")
    assert "dataset.blend_per_split" in str(info.value) and f"dataset.{name}=null" in str(
        info.value
    )
    overrides[name] = None
    cfg.dataset = dataclasses.replace(dataset, **overrides)
    check_section(vars(cfg), "dataset", 1, cuda_available=False)
