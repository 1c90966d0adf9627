"""The ``mimo`` recipe's rules about config sections (see :mod:`bridge.train.checks.rules`
for the convention): what its sections must hold, and the settings the recipe does not
implement, refused instead of ignored.

The recipe trains bridge.mimo's tiny vision-language model on synthetic data with its own
per-module layout (:mod:`bridge.train.models.mimo`): the ``model`` section is a
:class:`~bridge.train.models.mimo.MimoModelConfig` (whose own checks cover the model's
sizes), batch sizes count samples over all replicas of a module, and it has no dataset,
tokenizer, adapters, communication-overlap or mixed-precision settings, no evaluation and no
rerun state machine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bridge.config import (
    ConfigError,
    DistributedInitConfig,
    RerunStateMachineConfig,
    RNGConfig,
    TrainingConfig,
)
from bridge.train.models.mimo import MimoModelConfig, mimo_layout

__all__ = [
    "REQUIRED_SECTIONS",
    "check_required_sections",
    "layout_fits_world_and_batches",
    "length_and_batch_sizes_are_set",
    "no_rerun_state_machine",
    "section_is_unused",
    "unsupported_dist_settings",
    "unsupported_rng_settings",
    "unsupported_train_settings",
]

#: Sections every ``mimo`` run needs.
REQUIRED_SECTIONS = ("train", "optimizer", "scheduler", "logger", "checkpoint")


def check_required_sections(sections: dict[str, Any]) -> None:
    """The sections the recipe cannot do without are there and ``model`` is its config.

    Args:
        sections: Section name -> value, for :data:`REQUIRED_SECTIONS` and ``model``.
    """
    for name in REQUIRED_SECTIONS:
        if sections.get(name) is None:
            raise ConfigError(name, "required section is missing")
    if not isinstance(sections.get("model"), MimoModelConfig):
        raise ConfigError(
            "model._target_", "the mimo recipe needs bridge.train.models.mimo.MimoModelConfig"
        )


def length_and_batch_sizes_are_set(train: TrainingConfig) -> None:
    """The run's length and both batch sizes are set (nothing derives them for MIMO)."""
    if train.train_iters is None or train.train_iters < 1:
        raise ConfigError("train.train_iters", "set how many iterations to train (>= 1)")
    if train.global_batch_size is None or train.micro_batch_size is None:
        raise ConfigError(
            "train.global_batch_size",
            "the mimo recipe needs train.global_batch_size and train.micro_batch_size (both "
            "count samples over all replicas of a module)",
        )


def unsupported_train_settings(train: TrainingConfig) -> None:
    """``train`` settings the recipe's loop does not implement."""
    if train.eval_interval is not None and train.eval_iters > 0:
        raise ConfigError(
            "train.eval_interval",
            f"got {train.eval_interval} with train.eval_iters={train.eval_iters}; the MIMO "
            "recipe does not support evaluation: set train.eval_interval=null (or "
            "train.eval_iters=0)",
        )
    if train.skip_train:
        raise ConfigError(
            "train.skip_train",
            "got true; the MIMO recipe does not support it (it only trains): set "
            "train.skip_train=false",
        )
    interval = train.check_weight_hash_across_dp_replicas_interval
    if interval:
        raise ConfigError(
            "train.check_weight_hash_across_dp_replicas_interval",
            f"got {interval}; the MIMO recipe's modules have data-parallel groups of their "
            "own, which megatron's weight-hash check does not know: unset it",
        )


def unsupported_dist_settings(dist: DistributedInitConfig) -> None:
    """``dist`` settings the recipe does not apply: it uses the backend, the timeout, the
    device choice (``external_gpu_device_mapping``) and the experimental flag, and builds
    each module's groups with megatron-core's ``HyperCommGrid`` (no global rank order, no
    per-communicator NCCL settings, no SHARP or stream priorities) for modules it trains
    without overlapped gradient reduction."""
    defaults = DistributedInitConfig(local_rank=dist.local_rank)
    for name, meaning in (
        ("use_tp_pp_dp_mapping", "orders each module's ranks in its own grid"),
        ("nccl_communicator_config_path", "applies no per-communicator NCCL settings"),
        ("use_sharp", "does not set up SHARP"),
        ("high_priority_stream_groups", "sets no communicator stream priorities"),
        ("align_grad_reduce", "does not overlap gradient reduction with the backward pass"),
    ):
        value, default = getattr(dist, name), getattr(defaults, name)
        if value != default:
            raise ConfigError(
                f"dist.{name}",
                f"got {_yaml(value)}; the MIMO recipe {meaning} and would ignore it: set "
                f"dist.{name}={_yaml(default)}",
            )


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else repr(value)


def unsupported_rng_settings(rng: RNGConfig) -> None:
    """``rng`` settings the recipe does not act on: it seeds its modules with ``rng.seed``
    (and ``rng.layout_independent_init``) alone, through bridge-mimo's own set-up."""
    for name, meaning in (
        ("data_parallel_random_init", "draws every module once for all its data-parallel ranks"),
        ("te_rng_tracker", "sets up no CUDA RNG tracker"),
        ("inference_rng_tracker", "sets up no CUDA RNG tracker"),
    ):
        if getattr(rng, name):
            raise ConfigError(
                f"rng.{name}",
                f"got true; the MIMO recipe {meaning} and would ignore it: set rng.{name}=false",
            )


def layout_fits_world_and_batches(
    model: MimoModelConfig, train: TrainingConfig, world_size: int
) -> None:
    """``model.layout`` places every module on the launched world and the batch sizes
    divide every module's data-parallel size."""
    layout = mimo_layout(model, world_size)
    gbs, mbs = train.global_batch_size, train.micro_batch_size
    assert gbs is not None and mbs is not None  # length_and_batch_sizes_are_set runs first
    try:
        layout.validate(world_size)
        layout.validate_batch_sizes(gbs, mbs)
        model.tiny_vlm_config()
    except ValueError as exc:
        raise ConfigError("train", str(exc)) from None


def no_rerun_state_machine(rerun_state_machine: RerunStateMachineConfig) -> None:
    """The recipe's step does not run megatron-core's rerun state machine."""
    if rerun_state_machine.rerun_mode != "disabled":
        raise ConfigError(
            "rerun_state_machine.rerun_mode",
            f"got {rerun_state_machine.rerun_mode!r}; the MIMO recipe does not run "
            "megatron-core's rerun state machine: set rerun_mode='disabled'",
        )
    if rerun_state_machine.error_injection_rate:
        raise ConfigError(
            "rerun_state_machine.error_injection_rate",
            f"got {rerun_state_machine.error_injection_rate}; the MIMO recipe does not run "
            "megatron-core's rerun state machine, which injects these errors: set it to 0",
        )


def section_is_unused(name: str) -> Callable[[Any], None]:
    """The rule that refuses section ``name``, which the recipe does not use, when it is set.

    Args:
        name: A ``ConfigContainer`` field the recipe ignores.

    Returns:
        A rule taking that one section's value (the registry passes it).
    """

    def unused(value: Any) -> None:
        if value is not None:
            raise ConfigError(
                name,
                "is set, but the mimo recipe does not use it (it trains its own model on "
                f"synthetic data); remove the '{name}' section",
            )

    unused.__name__ = unused.__qualname__ = f"{name}_is_unused"
    return unused
