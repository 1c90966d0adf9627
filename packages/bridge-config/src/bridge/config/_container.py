"""``ConfigContainer``: every section of a training run, cross-checked and serialisable."""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import IO, Any, ClassVar, Self

from bridge.config._checkpoint import CheckpointConfig
from bridge.config._codec import (
    DEFAULT_CLASS,
    TARGET,
    build_dataclass,
    encode,
    import_object,
    normalize_fields,
)
from bridge.config._data import FinetuningDatasetConfig, GPTDatasetConfig
from bridge.config._ddp import DistributedDataParallelConfig
from bridge.config._diff import ConfigDiff, diff_from_defaults
from bridge.config._errors import ConfigError
from bridge.config._load_order import sections_needing_no_import_first
from bridge.config._logger import LoggerConfig, ProfilingConfig
from bridge.config._protocols import (
    CommOverlapConfigProtocol,
    DDPConfigProtocol,
    MixedPrecisionConfigProtocol,
    ModelConfigProtocol,
    OptimizerConfigProtocol,
    PEFTProtocol,
    TokenizerConfigProtocol,
)
from bridge.config._resiliency import (
    FaultToleranceConfig,
    NVRxStragglerDetectionConfig,
    StragglerDetectionConfig,
)
from bridge.config._runtime import DistributedInitConfig, RerunStateMachineConfig, RNGConfig
from bridge.config._samples import SamplesConfig
from bridge.config._section import clear_fill_ins, config_section, fill_in, restore_fill_ins
from bridge.config._tokenizer import TokenizerConfig, total_vocab_size
from bridge.config._training import (
    SchedulerConfig,
    TrainingConfig,
    rampup_increments,
    scheduler_steps,
    warn_deprecated_engine,
)
from bridge.config._value_ranges import check_learning_rates, check_value_ranges
from bridge.config._yaml import (
    dump_yaml,
    escape_interpolations,
    naming_interpolation_sources,
    read_yaml_mapping,
    resolve_interpolations,
    write_new_file,
)

# Sections validate() cannot do without, and how to add each one.
_REQUIRED_SECTIONS: dict[str, str] = {
    "train": "add a 'train:' mapping (e.g. train: {micro_batch_size: 1, train_iters: 100})",
    "model": "add a 'model:' mapping whose _target_ names a model config class (a megatron "
    "TransformerConfig subclass with seq_length, such as a model provider)",
    "optimizer": "add an 'optimizer:' mapping with _target_: megatron.core.optimizer.OptimizerConfig",
    "scheduler": "add a 'scheduler:' mapping ('scheduler: {}' uses the defaults)",
    "logger": "add a 'logger:' mapping ('logger: {}' uses the defaults)",
    "checkpoint": "add a 'checkpoint:' mapping ('checkpoint: {}' uses the defaults)",
}


def resolve_world_size(world_size: int | None = None) -> int:
    """The world size ``validate()`` uses.

    Args:
        world_size: An explicit size, used as given.

    Returns:
        ``world_size`` if given; else the size of the initialised default torch.distributed
        process group; else the ``WORLD_SIZE`` environment variable (set by torchrun); else 1.

    Raises:
        ConfigError: the size is not a positive integer.
    """
    if world_size is None:
        dist = sys.modules.get("torch.distributed")  # only consulted if torch is in use
        if dist is not None and dist.is_available() and dist.is_initialized():
            world_size = int(dist.get_world_size())
        else:
            raw = os.environ.get("WORLD_SIZE", "1")
            try:
                world_size = int(raw)
            except ValueError:
                raise ConfigError(
                    "WORLD_SIZE", f"got {raw!r}; expected a positive integer"
                ) from None
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError("world_size", f"got {world_size!r}; expected a positive integer")
    return world_size


def _dtype_family(dtype: Any) -> str | None:
    text = str(dtype)
    if "bfloat16" in text:
        return "bf16"
    if "float16" in text:
        return "fp16"
    return None


def _parallel_size(model: ModelConfigProtocol, name: str, default: int) -> int:
    size = getattr(model, name, default)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"model.{name}", f"got {size!r}; expected a positive integer")
    return size


def _check_expert_layout(model: ModelConfigProtocol, world: int, tp: int, pp: int) -> None:
    """Megatron's expert-parallel rules (see :func:`data_parallel_size`)."""
    ep = _parallel_size(model, "expert_model_parallel_size", 1)
    etp = tp
    if getattr(model, "expert_tensor_parallel_size", None) is not None:
        etp = _parallel_size(model, "expert_tensor_parallel_size", tp)
    experts = getattr(model, "num_moe_experts", None)
    if experts is not None and (
        isinstance(experts, bool) or not isinstance(experts, int) or experts < 1
    ):
        raise ConfigError(
            "model.num_moe_experts",
            f"got {experts!r}; expected a positive integer (or null for a dense model)",
        )
    if ep > 1 and experts is None and hasattr(model, "num_moe_experts"):
        raise ConfigError(
            "model.num_moe_experts",
            f"is unset but expert_model_parallel_size is {ep}; expert parallelism splits the "
            f"MoE experts across ranks: set num_moe_experts (a multiple of {ep}) or set "
            "expert_model_parallel_size to 1",
        )
    unit = etp * ep * pp
    layout = (
        f"expert_tensor_parallel_size ({etp}) x expert_model_parallel_size ({ep}) x "
        f"pipeline_model_parallel_size ({pp}) = {unit}"
    )
    if world % (etp * pp):  # no expert-parallel size can fit: the expert TP size is at fault
        valid = [t for t in range(1, world + 1) if world % (t * ep * pp) == 0] or [
            t for t in range(1, world + 1) if world % (t * pp) == 0
        ]
        raise ConfigError(
            "model.expert_tensor_parallel_size",
            f"got {etp}; world size {world} is not divisible by {layout}; valid "
            f"expert_tensor_parallel_size values for {world} ranks: {_listing(valid)} (or "
            f"leave it unset to use tensor_model_parallel_size, {tp})",
        )
    valid = [
        e
        for e in range(1, world // (etp * pp) + 1)
        if world % (etp * e * pp) == 0 and (experts is None or experts % e == 0)
    ]
    if experts is not None and experts % ep:
        raise ConfigError(
            "model.expert_model_parallel_size",
            f"got {ep}; num_moe_experts ({experts}) is not divisible by it; valid "
            f"expert_model_parallel_size values for {world} ranks: {_listing(valid)}",
        )
    if world % unit:
        raise ConfigError(
            "model.expert_model_parallel_size",
            f"got {ep}; world size {world} is not divisible by {layout}; valid "
            f"expert_model_parallel_size values for {world} ranks: {_listing(valid)} (or "
            f"launch a multiple of {unit} ranks)",
        )


def data_parallel_size(model: ModelConfigProtocol, world_size: int) -> int:
    """The data-parallel size of a model's parallel layout on ``world_size`` ranks.

    As in megatron-core, the data-parallel size is ``world_size // (tensor x pipeline x
    context parallel size)``; expert parallelism splits the experts within those ranks and
    does not change it. The expert layout must still fit: ``world_size`` must be a multiple
    of ``expert_tensor_parallel_size`` (default: the tensor-parallel size) x
    ``expert_model_parallel_size`` x pipeline-parallel size, and ``num_moe_experts`` (when
    set) a multiple of ``expert_model_parallel_size``. A model without these fields has no
    expert parallelism.

    Args:
        model: The model section (a provider or any object with the parallel-size fields).
        world_size: Total number of ranks.

    Returns:
        ``world_size // (tensor x pipeline x context parallel size)``.

    Raises:
        ConfigError: a parallel size is not a positive integer, ``world_size`` is not a
            multiple of their product, or the expert layout does not fit (the message lists
            valid choices).
    """
    tp, pp, cp = (
        _parallel_size(model, name, 1)
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
        )
    )
    model_parallel = tp * pp * cp
    if world_size % model_parallel:
        raise ConfigError(
            "model",
            f"world size {world_size} is not divisible by tensor_model_parallel_size ({tp}) "
            f"x pipeline_model_parallel_size ({pp}) x context_parallel_size ({cp}) "
            f"= {model_parallel}; launch a multiple of {model_parallel} ranks or change the "
            "parallel sizes",
        )
    _check_expert_layout(model, world_size, tp, pp)
    return world_size // model_parallel


def _listing(values: list[int]) -> str:
    return ", ".join(str(v) for v in values)


@config_section
@dataclass(kw_only=True)
class ConfigContainer:
    """Top-level container holding all configuration objects.

    Sections default to ``None`` (``rng``, ``rerun_state_machine``, ``ddp`` and ``dist``
    to their defaults), so an empty container can be built and filled in; ``validate()``
    reports a missing required section. Build one in Python, from a dict
    (``from_dict``) or from YAML (``from_yaml``, ``load_config``).
    """

    __config_key_noun__: ClassVar[str] = "section"

    rng: RNGConfig = field(default_factory=RNGConfig)
    """Random seeds and generator trackers."""

    rerun_state_machine: RerunStateMachineConfig = field(default_factory=RerunStateMachineConfig)
    """Result validation by re-running steps."""

    train: TrainingConfig | None = None
    """Training loop: batch sizes, length, exit conditions, evaluation, engine. Required."""

    model: ModelConfigProtocol | None = None
    """Model configuration, any object providing ``ModelConfigProtocol`` (a megatron-core
    ``TransformerConfig`` subclass with ``seq_length``, e.g. a model provider). In YAML its
    ``_target_`` names the class. Required."""

    optimizer: OptimizerConfigProtocol | None = None
    """Optimizer configuration, any object providing ``OptimizerConfigProtocol`` (e.g.
    ``megatron.core.optimizer.OptimizerConfig``). Required."""

    ddp: DDPConfigProtocol = field(
        default_factory=DistributedDataParallelConfig,
        metadata={DEFAULT_CLASS: DistributedDataParallelConfig},
    )
    """Data-parallel settings: bridge.config's ``DistributedDataParallelConfig`` (megatron's
    field names, no megatron-core needed) unless ``_target_`` names another class such as
    ``megatron.core.distributed.DistributedDataParallelConfig``."""

    scheduler: SchedulerConfig | None = None
    """Learning-rate and weight-decay schedule. Required."""

    dataset: GPTDatasetConfig | FinetuningDatasetConfig | None = None
    """Training data. Without ``_target_`` a mapping is read as ``GPTDatasetConfig`` (or
    ``FinetuningDatasetConfig`` if its keys only fit that); use
    ``_target_: bridge.config.MockGPTDatasetConfig`` for mock data."""

    logger: LoggerConfig | None = None
    """Console, TensorBoard and Weights & Biases logging. Required."""

    tokenizer: TokenizerConfig | TokenizerConfigProtocol | None = None
    """Tokenizer the trainer builds for datasets and the model: a ``TokenizerConfig``, or
    any object providing ``TokenizerConfigProtocol`` (in YAML, with a ``_target_``)."""

    checkpoint: CheckpointConfig | None = None
    """Checkpoint saving and loading. Required."""

    dist: DistributedInitConfig = field(default_factory=DistributedInitConfig)
    """torch.distributed initialisation."""

    ft: FaultToleranceConfig | None = None
    """Fault tolerance with nvidia-resiliency-ext (unset: off)."""

    straggler: StragglerDetectionConfig | None = None
    """Straggler detection by per-rank throughput (unset: off)."""

    nvrx_straggler: NVRxStragglerDetectionConfig | None = None
    """nvidia-resiliency-ext straggler detection (unset: off)."""

    profiling: ProfilingConfig | None = None
    """Profiling with Nsight Systems or the torch profiler (unset: off)."""

    samples: SamplesConfig | None = None
    """Sample completions generated at evaluation time while training (unset: none)."""

    peft: PEFTProtocol | None = None
    """Parameter-efficient finetuning transform applied to the model (unset: full
    finetuning). Needs ``checkpoint.pretrained_checkpoint``."""

    comm_overlap: CommOverlapConfigProtocol | None = None
    """Communication-overlap settings; ``validate()`` fills in their ``data_parallel_size``
    when it is unset."""

    mixed_precision: MixedPrecisionConfigProtocol | str | None = None
    """Mixed-precision recipe: an object providing ``MixedPrecisionConfigProtocol`` or a
    recipe name such as ``"bf16_mixed"`` that the trainer resolves. Checked against the
    model's ``bf16``/``fp16`` flags."""

    callbacks: list[Any] = field(default_factory=list)
    """Training-loop callbacks: instances of ``bridge.train.Callback``
    (``core_utils.Callback``) subclasses, run in this order at every hook of the loop
    (``validate()`` refuses anything else). In YAML a list of
    ``{_target_: package.module.Class, <argument>: <value>, ...}`` entries; a dataclass
    callback is saved with its fields in ``run_config.yaml``, any other class only when it
    has no instance state. (Typed ``Any`` so that bridge.config does not import torch.)"""

    data_parallel_size: int | None = field(init=False, default=None)
    """Data-parallel size (world size divided by tensor x pipeline x context parallel
    sizes; expert parallelism does not change it). Computed by ``validate()``; not
    settable."""

    def __post_init__(self) -> None:
        """Check that every section has the expected type (or provides its Protocol)."""
        normalize_fields(self)

    # ------------------------------------------------------------------ derived values

    def get_data_parallel_size(self, world_size: int) -> int:
        """The data-parallel size of the model section's layout (:func:`data_parallel_size`).

        Raises:
            ConfigError: there is no model section, or :func:`data_parallel_size` refuses
                the layout.
        """
        world_size = resolve_world_size(world_size)
        if self.model is None:
            raise ConfigError(
                "model", "required section is missing; " + _REQUIRED_SECTIONS["model"]
            )
        return data_parallel_size(self.model, world_size)

    def validate(self, world_size: int | None = None) -> None:
        """Performs validation checks on the combined configuration.

        Calculates dependent values like data_parallel_size and scheduler steps. Ensures
        compatibility between different configuration settings. Re-runs every section's own
        checks first (fields may have been changed since construction), then, in place:
        fills ``data_parallel_size``, ``train.global_batch_size`` (when unset:
        ``micro_batch_size`` x data-parallel size), ``scheduler.lr_decay_iters`` (or
        ``lr_decay_samples``) and the scheduler's ``*_steps`` (counted in samples, as
        megatron-core's scheduler expects), and ``comm_overlap.data_parallel_size`` (when
        unset); then ``comm_overlap.setup(model, optimizer, ddp)`` writes the overlap
        settings into those sections.

        Values filled into fields the user left unset stay marked as derived: ``to_yaml``
        and ``to_dict`` save them as unset (``null``), ``apply_overrides`` clears them in
        its copy, and the next ``validate()`` derives them again from the current values
        and world size. Assigning such a field makes it the user's value, which is then
        kept and checked. Calling it again gives the same result; if it fails, the values
        derived by the last successful call are kept.

        Args:
            world_size: Number of ranks. When omitted: the initialised torch.distributed
                world size, else the ``WORLD_SIZE`` environment variable, else 1.

        Raises:
            ConfigError: a required section is missing or any check fails; the message
                names the ``section.field`` to change.
        """
        for name, hint in _REQUIRED_SECTIONS.items():
            if getattr(self, name) is None:
                raise ConfigError(name, f"required section is missing; {hint}")
        if self.train is not None and self.train.engine is not None:
            warn_deprecated_engine(self.train.engine)
        # Derive afresh: values an earlier call filled in may be stale (other world size,
        # overridden train_iters).
        cleared = self._clear_derived_values()
        try:
            self._validate(resolve_world_size(world_size))
        except BaseException:
            for obj, values in cleared:
                restore_fill_ins(obj, values)
            raise

    def _clear_derived_values(self) -> list[tuple[Any, dict[str, Any]]]:
        """Unset every value a previous ``validate()`` filled in (see ``validate``).

        Returns:
            ``(object, {field: value})`` for each object that had derived values, in case
            they must be put back.
        """
        cleared = []
        for obj in (self, *(getattr(self, f.name) for f in dataclasses.fields(self))):
            values = clear_fill_ins(obj) if obj is not None else {}
            if values:
                cleared.append((obj, values))
        return cleared

    def _validate(self, world: int) -> None:
        self._recheck_sections()
        check_value_ranges(self.optimizer, self.model)
        assert self.optimizer is not None  # a required section (validate())
        check_learning_rates(self.optimizer, self.scheduler)
        dp = self.get_data_parallel_size(world)
        fill_in(self, "data_parallel_size", dp)
        self._fill_comm_overlap(dp)
        self._check_batch_sizes(dp)
        self._check_training_length()
        self._fill_scheduler_steps()
        self._check_model(world)
        self._check_data_and_tokenizer()
        self._check_other_sections(world)

    def _recheck_sections(self) -> None:
        normalize_fields(self)
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            own = type(section).__module__.startswith("bridge.config")
            if own and dataclasses.is_dataclass(section) and hasattr(section, "__post_init__"):
                try:
                    section.__post_init__()
                except ConfigError as exc:
                    raise exc.within(f.name, type(section).__name__) from exc.__cause__

    def _fill_comm_overlap(self, dp: int) -> None:
        overlap = self.comm_overlap
        if overlap is None:
            return
        current = overlap.data_parallel_size
        if current is None:
            fill_in(overlap, "data_parallel_size", dp)
        elif current != dp:
            raise ConfigError(
                "comm_overlap.data_parallel_size",
                f"got {current!r} but the data-parallel size is {dp}; leave it unset "
                "(validate() fills it in) or set it to the actual size",
            )
        overlap.setup(self.model, self.optimizer, self.ddp)

    def _check_batch_sizes(self, dp: int) -> None:
        train = self.train
        assert train is not None
        mbs = train.micro_batch_size
        if mbs is None:
            raise ConfigError(
                "train.micro_batch_size", "is required; set the per-replica batch size, e.g. 1"
            )
        unit = mbs * dp
        per_step = f"micro_batch_size ({mbs}) x data-parallel size ({dp}) = {unit}"
        if train.global_batch_size is None:
            fill_in(train, "global_batch_size", unit)
        gbs = train.global_batch_size
        assert gbs is not None
        if gbs < unit:
            raise ConfigError(
                "train.global_batch_size", f"got {gbs}; it must be at least {per_step}"
            )
        if gbs % unit and not train.decrease_batch_size_if_needed:
            raise ConfigError(
                "train.global_batch_size",
                f"got {gbs}; it must be a multiple of {per_step} (or set "
                "train.decrease_batch_size_if_needed)",
            )
        if train.rampup_batch_size is None:
            return
        start, increment, _ = train.rampup_batch_size
        if train.train_samples is None:
            raise ConfigError(
                "train.rampup_batch_size",
                "batch-size ramp-up needs sample-based training; set train.train_samples "
                "instead of train.train_iters",
            )
        if train.decrease_batch_size_if_needed:
            raise ConfigError(
                "train.rampup_batch_size",
                "cannot be combined with train.decrease_batch_size_if_needed (megatron-core's "
                "step batch-size schedules do not support it); unset one of them",
            )
        rampup_increments(train)
        if start % unit or increment % unit:
            raise ConfigError(
                "train.rampup_batch_size",
                f"the start batch size ({start}) and increment ({increment}) must be multiples "
                f"of {per_step}",
            )

    def _check_training_length(self) -> None:
        train, scheduler = self.train, self.scheduler
        assert train is not None and scheduler is not None
        if train.train_iters is None and train.train_samples is None and not train.skip_train:
            raise ConfigError(
                "train.train_iters",
                "is required (or train.train_samples for sample-based training); set how long to train",
            )
        if train.train_samples is not None:
            wrong = [
                n
                for n in ("lr_decay_iters", "lr_wsd_decay_iters")
                if getattr(scheduler, n) is not None
            ]
            wrong += ["lr_warmup_iters"] if scheduler.lr_warmup_iters else []
            if wrong:
                raise ConfigError(
                    f"scheduler.{wrong[0]}",
                    "counts iterations but train.train_samples selects sample-based training; "
                    f"use the *_samples field instead (e.g. {wrong[0].replace('_iters', '_samples')})",
                )
        else:
            wrong = [
                n
                for n in ("lr_decay_samples", "lr_wsd_decay_samples")
                if getattr(scheduler, n) is not None
            ]
            wrong += ["lr_warmup_samples"] if scheduler.lr_warmup_samples else []
            if wrong:
                raise ConfigError(
                    f"scheduler.{wrong[0]}",
                    "counts samples but train.train_iters selects iteration-based training; use "
                    f"the *_iters field instead (e.g. {wrong[0].replace('_samples', '_iters')}) "
                    "or set train.train_samples",
                )

    def _fill_scheduler_steps(self) -> None:
        train, scheduler = self.train, self.scheduler
        assert train is not None and scheduler is not None
        if train.train_samples is not None and scheduler.lr_decay_samples is None:
            fill_in(scheduler, "lr_decay_samples", train.train_samples)
        elif train.train_iters is not None and scheduler.lr_decay_iters is None:
            fill_in(scheduler, "lr_decay_iters", train.train_iters)
        steps = scheduler_steps(scheduler, train)
        for name, value in (steps or {}).items():  # None: skip_train without a length
            fill_in(scheduler, name, value)

    def _check_model(self, world: int) -> None:
        model, optimizer, train = self.model, self.optimizer, self.train
        assert model is not None and optimizer is not None and train is not None
        tp, cp = model.tensor_model_parallel_size, model.context_parallel_size
        if model.num_attention_heads % tp:
            raise ConfigError(
                "model.num_attention_heads",
                f"got {model.num_attention_heads}; it must be divisible by tensor_model_parallel_size ({tp})",
            )
        if cp > 1 and model.seq_length % (2 * cp):
            raise ConfigError(
                "model.seq_length",
                f"got {model.seq_length}; with context_parallel_size {cp} it must be divisible by "
                f"2 x {cp} = {2 * cp}",
            )
        if model.bf16 and model.fp16:
            raise ConfigError("model", "bf16 and fp16 are both true; enable at most one")
        self._check_precision()
        ddp_flag = getattr(self.ddp, "use_distributed_optimizer", None)
        if ddp_flag is not None and ddp_flag != optimizer.use_distributed_optimizer:
            raise ConfigError(
                "ddp.use_distributed_optimizer",
                f"got {ddp_flag} but optimizer.use_distributed_optimizer is "
                f"{optimizer.use_distributed_optimizer}; set both to the same value",
            )

    def _check_precision(self) -> None:
        model, optimizer = self.model, self.optimizer
        assert model is not None and optimizer is not None
        mp = self.mixed_precision
        model_mode = "bf16" if model.bf16 else "fp16" if model.fp16 else None
        if mp is None:
            optimizer_mode = "bf16" if optimizer.bf16 else "fp16" if optimizer.fp16 else None
            if optimizer_mode != model_mode:
                raise ConfigError(
                    "optimizer",
                    f"optimizer.bf16={optimizer.bf16}, optimizer.fp16={optimizer.fp16} do not match "
                    f"model.bf16={model.bf16}, model.fp16={model.fp16}; set the same flags on both "
                    "(or set mixed_precision, which sets them)",
                )
            dtype_mode = _dtype_family(model.params_dtype)
            if dtype_mode is not None and model_mode is not None and dtype_mode != model_mode:
                raise ConfigError(
                    "model.params_dtype",
                    f"got {model.params_dtype} but model.{model_mode} is true; use the matching dtype",
                )
            return
        if isinstance(mp, str):
            lowered = mp.lower()
            mp_mode = "bf16" if "bf16" in lowered else "fp16" if "fp16" in lowered else None
            label = repr(mp)
        else:
            if mp.bf16 and mp.fp16:
                raise ConfigError(
                    "mixed_precision", "bf16 and fp16 are both true; enable at most one"
                )
            mp_mode = "bf16" if mp.bf16 else "fp16" if mp.fp16 else None
            label = type(mp).__qualname__
        if model_mode is not None and model_mode != mp_mode:
            raise ConfigError(
                "mixed_precision",
                f"{label} selects {mp_mode or 'fp32'} but model.{model_mode} is true; drop the "
                "model's flag (the recipe sets it) or choose a matching recipe",
            )

    def _check_data_and_tokenizer(self) -> None:
        model, train = self.model, self.train
        assert model is not None and train is not None
        dataset = self.dataset
        if dataset is not None:
            length: int | None
            if isinstance(dataset, FinetuningDatasetConfig):
                name, length = "dataset.seq_length", dataset.seq_length
                if length is None:
                    raise ConfigError(
                        name,
                        "is required for a finetuning dataset (tokens per sample); set it to "
                        f"model.seq_length ({model.seq_length})",
                    )
                specs = dataset.packed_sequence_specs
                mbs = train.micro_batch_size or 1
                if specs is not None and specs.packed_sequence_size > 0 and mbs > 1:
                    raise ConfigError(
                        "train.micro_batch_size",
                        f"got {mbs}; packed sequences need micro_batch_size 1 (pack "
                        f"{mbs} x {specs.packed_sequence_size} tokens per sequence instead)",
                    )
            else:
                name, length = "dataset.sequence_length", dataset.sequence_length
            if length != model.seq_length:
                raise ConfigError(
                    name,
                    f"got {length} but model.seq_length is {model.seq_length}; they must be equal",
                )
        tokenizer = self.tokenizer
        model_vocab = getattr(model, "vocab_size", None)
        total = total_vocab_size(tokenizer) if tokenizer is not None else None
        if (
            tokenizer is not None
            and total is not None
            and isinstance(model_vocab, int)
            and total > model_vocab
        ):
            if tokenizer.tokenizer_type == "ByteLevelTokenizer" and tokenizer.vocab_size is None:
                origin = "256 bytes, special tokens and extra ids"
            else:
                origin = (
                    f"vocab_size {tokenizer.vocab_size} + vocab_extra_ids "
                    f"{tokenizer.vocab_extra_ids}"
                )
            raise ConfigError(
                "tokenizer.vocab_size",
                f"the tokenizer emits {total} ids ({origin}) but model.vocab_size is "
                f"{model_vocab}; raise model.vocab_size to at least {total} (or leave it unset "
                "to take it from the tokenizer)",
            )

    def _check_other_sections(self, world: int) -> None:
        checkpoint = self.checkpoint
        assert checkpoint is not None
        if self.ft is not None:
            if self.ft.enable_ft_package and checkpoint.save is None:
                raise ConfigError(
                    "ft.enable_ft_package",
                    "fault tolerance restarts training from checkpoints; set checkpoint.save",
                )
            rank = self.ft.simulated_fault_rank
            if rank is not None and rank >= world:
                raise ConfigError(
                    "ft.simulated_fault_rank", f"got {rank}; the world has ranks 0 to {world - 1}"
                )
        if self.profiling is not None:
            absent = [r for r in self.profiling.profile_ranks if r >= world]
            if absent:
                raise ConfigError(
                    "profiling.profile_ranks",
                    f"rank(s) {absent} do not exist; the world has ranks 0 to {world - 1}",
                )
        train = self.train
        if (
            self.samples is not None
            and train is not None
            and not train.skip_train
            and not (train.eval_interval and train.eval_iters)
        ):
            raise ConfigError(
                "samples",
                "sample completions are generated at evaluation time; set "
                "train.eval_interval and train.eval_iters > 0 (or unset samples)",
            )
        if self.callbacks:
            # Only here: core_utils imports torch, which a config without callbacks never needs.
            from core_utils.callbacks import Callback
        for index, callback in enumerate(self.callbacks):
            if not isinstance(callback, Callback):
                raise ConfigError(
                    f"callbacks[{index}]",
                    f"got {type(callback).__qualname__}, which is not a training-loop callback; "
                    "name a subclass of bridge.train.Callback (core_utils.Callback) in _target_",
                )
        if self.peft is not None and checkpoint.pretrained_checkpoint is None:
            raise ConfigError(
                "checkpoint.pretrained_checkpoint",
                "is required with peft; point it at the model to finetune",
            )

    # ------------------------------------------------------------------ serialisation

    def to_dict(self) -> dict[str, Any]:
        """Return the config as plain data: ``_target_``-tagged nested dicts and scalars.

        Raises:
            ConfigError: a value cannot be represented so that ``from_dict`` rebuilds it
                (e.g. a lambda); the message names its path.
        """
        data = encode(self)
        assert isinstance(data, dict)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """Build a container from plain data as ``to_dict`` returns it.

        ``_target_`` keys are optional where the field's type says which class to build (all
        bridge.config sections); they are required for ``model``, ``optimizer``, ``peft``,
        ``comm_overlap`` and object-valued ``mixed_precision``. Values are used as they are:
        OmegaConf interpolations are only resolved when reading YAML.

        Raises:
            ConfigError: unknown key (with a suggestion), wrong type, out-of-range value,
                an import that fails, or any section check; the message names the path.
        """
        if not isinstance(data, dict):
            raise ConfigError("", f"expected a mapping of sections, got {type(data).__name__}")
        target_cls: type = cls
        if TARGET in data:
            target_cls = import_object(data[TARGET], TARGET)
            if not (isinstance(target_cls, type) and issubclass(target_cls, cls)):
                raise ConfigError(TARGET, f"{data[TARGET]!r} is not a {cls.__qualname__}")
        return build_dataclass(target_cls, sections_needing_no_import_first(data), "")

    def to_yaml(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
        """Save the config as YAML that ``from_yaml`` loads back to an equal container.

        Strings containing ``${`` are escaped so OmegaConf keeps them literal. The file is
        written atomically.

        Args:
            path: File to write.
            overwrite: Replace an existing file (by default an existing file is an error,
                so nothing saved is lost).

        Raises:
            ConfigError: the file exists and ``overwrite`` is False, it cannot be written, or
                a value cannot be represented.
        """
        write_new_file(path, self.to_yaml_text(), overwrite=overwrite)

    def to_yaml_text(self) -> str:
        """The YAML text :meth:`to_yaml` writes (it loads back with ``from_yaml``).

        Raises:
            ConfigError: a value cannot be represented.
        """
        return dump_yaml(escape_interpolations(self.to_dict()))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> Self:
        """Load a container from a YAML file, resolving OmegaConf interpolations.

        Raises:
            ConfigError: the file is missing or not valid YAML, an interpolation cannot be
                resolved, or ``from_dict`` rejects the content.
        """
        data = read_yaml_mapping(path)
        with naming_interpolation_sources(data):
            return cls.from_dict(resolve_interpolations(data, str(path)))

    def format_yaml(self) -> str:
        """The resolved config as YAML text, for printing (values that cannot be saved are
        shown as descriptive strings instead of raising). Unlike ``to_yaml`` it shows the
        fields a model config derived from its others (``ffn_hidden_size``, init methods,
        ...); runtime hooks are left out of both."""
        return dump_yaml(encode(self, strict=False, omit_derived=False))

    def print_yaml(self, file: IO[str] | None = None) -> None:
        """Print the resolved config as YAML to ``file`` (default: standard output)."""
        print(self.format_yaml(), end="", file=file or sys.stdout)

    def diff_from_defaults(self) -> list[ConfigDiff]:
        """List every value that differs from its declared default, as ``ConfigDiff`` entries.

        Each section is compared with the defaults of its own class; a section whose class
        differs from the field's default (or that is set where the default is ``None``) is
        reported with its ``_target_`` first. Format the result with ``format_diff``.
        """
        return diff_from_defaults(self)
