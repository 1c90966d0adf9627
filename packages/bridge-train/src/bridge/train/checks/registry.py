"""The one registry of the trainer's config rules, keyed by section.

:data:`REGISTRY` maps every ``ConfigContainer`` section to the trainer's rules about it, in
the order they run; :data:`SECTIONS` is the order of the sections. A rule says which kinds
of run it applies to: GPT-style runs (``pretrain`` / ``finetune``: GPT, T5, Mamba models)
or the ``mimo`` recipe. Rules a section can check on its own (types, ranges, fields that
exclude each other, cross-section arithmetic such as batch sizes) are bridge-config's and
run first, in ``ConfigContainer.validate()``; the rules here need megatron-core, the files
a run reads and writes, this machine or the trainer's knowledge of what it implements.
:func:`bridge.train.checks.preflight.check_config_before_launch` runs them all in one
pass.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from bridge.config import check_learning_rates
from bridge.train.checkpointing.context import check_checkpoint_config
from bridge.train.checks import mimo, resume, rules
from bridge.train.checks.layout import check_engine_config
from bridge.train.data.t5_datasets import check_t5_data_config
from bridge.train.engine.initialize import resolve_distributed_backend
from bridge.train.engine.scheduler import scheduler_steps

__all__ = ["BOTH", "FACTS", "GPT", "MIMO", "REGISTRY", "SECTIONS", "Rule", "RunKind"]

#: The kinds of run the trainer checks a config for.
RunKind = Literal["gpt", "mimo"]

GPT: frozenset[RunKind] = frozenset({"gpt"})
MIMO: frozenset[RunKind] = frozenset({"mimo"})
BOTH: frozenset[RunKind] = GPT | MIMO

#: What a rule may read besides config sections: the launch's facts.
FACTS = ("world_size", "cuda_available")


@dataclass(frozen=True)
class Rule:
    """One rule of the registry.

    Attributes:
        check: Raises :class:`bridge.config.ConfigError` for the first problem it finds.
        runs: The kinds of run it applies to.
        reads: What ``check`` is called with, in order: section names (``ConfigContainer``
            fields) and :data:`FACTS`; by default its parameter names.
    """

    check: Callable[..., object]
    runs: frozenset[RunKind] = BOTH
    reads: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.reads:
            object.__setattr__(self, "reads", tuple(inspect.signature(self.check).parameters))

    def __call__(self, values: Mapping[str, Any]) -> None:
        """Run the check on what it reads of ``values`` (sections by name and facts)."""
        self.check(*(values[name] for name in self.reads))


def _unused_by_mimo(name: str) -> Rule:
    return Rule(mimo.section_is_unused(name), MIMO, (name,))


#: Section -> the trainer's rules about it, in the order they run; the pass visits the
#: sections in this order.
REGISTRY: dict[str, tuple[Rule, ...]] = {
    "model": (
        # What the engine cannot run correctly on this machine (pipeline p2p modes,
        # GPU-only features without CUDA). That the layout fits the world is validate()'s
        # (ConfigContainer.get_data_parallel_size).
        Rule(check_engine_config, GPT, ("model", "ddp", "optimizer", "cuda_available")),
    ),
    "train": (
        Rule(rules.evaluation_has_validation_data, GPT),
        Rule(rules.dataset_index_fits_memory, GPT),
        Rule(mimo.length_and_batch_sizes_are_set, MIMO),
        Rule(mimo.unsupported_train_settings, MIMO),
        Rule(mimo.layout_fits_world_and_batches, MIMO),
    ),
    # validate() applies it to the other runs.
    "optimizer": (Rule(check_learning_rates, MIMO, ("optimizer", "scheduler")),),
    # The learning-rate schedule fits the run's length (megatron's sample-based steps).
    "scheduler": (Rule(scheduler_steps, MIMO, ("scheduler", "train")),),
    "dist": (
        # dist.distributed_backend works on this machine.
        Rule(resolve_distributed_backend, reads=("dist",)),
        Rule(rules.dist_settings_are_implemented),
        # dist.local_rank (this process's GPU) is the launcher's where it gives one.
        Rule(rules.local_rank_is_the_launchers),
        Rule(mimo.unsupported_dist_settings, MIMO),
        Rule(rules.sharp_and_stream_priority_need_nccl, GPT),
    ),
    "rng": (
        Rule(rules.initialisation_is_possible, BOTH),
        Rule(mimo.unsupported_rng_settings, MIMO),
    ),
    "rerun_state_machine": (
        Rule(rules.rerun_state_machine_needs_cuda, GPT),
        Rule(mimo.no_rerun_state_machine, MIMO),
    ),
    "tokenizer": (
        Rule(rules.tokenizer_can_be_built, GPT),
        Rule(rules.hf_tokenizer_files_exist, GPT),
        Rule(rules.vocabulary_is_known, GPT),
        _unused_by_mimo("tokenizer"),
    ),
    "dataset": (
        Rule(rules.dataset_is_given, GPT),
        Rule(rules.data_is_sharded, GPT),
        Rule(rules.data_paths_exist, GPT),
        Rule(rules.data_files_are_sound, GPT),
        Rule(rules.data_splits_hold_samples, GPT),
        # T5 span-corruption data and its tokenizer's sentinel tokens fit together.
        Rule(check_t5_data_config, GPT, ("dataset", "tokenizer")),
        Rule(rules.finetuning_dataset_is_supported, GPT),
        Rule(rules.validation_sets_can_be_separate, GPT),
        _unused_by_mimo("dataset"),
    ),
    "peft": (Rule(rules.peft_is_a_transform, GPT), _unused_by_mimo("peft")),
    "samples": (Rule(rules.samples_can_be_generated, GPT), _unused_by_mimo("samples")),
    "comm_overlap": (_unused_by_mimo("comm_overlap"),),
    "mixed_precision": (_unused_by_mimo("mixed_precision"),),
    "checkpoint": (
        # Settings this trainer cannot honour (formats, non-persistent types, conversion,
        # CUDA-only loading), refused whether or not the run saves.
        Rule(check_checkpoint_config, reads=("checkpoint",)),
        # The mimo recipe refuses an absent or foreign checkpoint when it loads
        # (CheckpointError, naming exit_on_missing_checkpoint), as its docs say.
        Rule(rules.load_directory_exists, GPT),
        Rule(rules.checkpoint_directories_hold_runs, GPT),
        Rule(rules.save_directory_is_writable),
        # What a resume would load (the mimo recipe checks its own checkpoint when it
        # loads): the same model, data, tokenizer and PEFT settings.
        Rule(resume.resume_matches_run, GPT),
    ),
    "logger": (Rule(rules.logger_directories_are_writable),),
    "profiling": (
        Rule(rules.nsys_needs_cuda),
        Rule(rules.profiler_has_a_trace_directory),
    ),
    "nvrx_straggler": (Rule(rules.nvrx_needs_cuda),),
}

#: The order in which the pass visits the sections (the registry's).
SECTIONS: tuple[str, ...] = tuple(REGISTRY)
