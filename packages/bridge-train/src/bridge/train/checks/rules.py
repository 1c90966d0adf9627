"""The trainer's rules about config sections: what a section accepts but the trainer
cannot honour, or cannot honour on this machine.

A rule's parameters are named after what it reads (sections as ``ConfigContainer`` names
them, and the launch's ``world_size`` / ``cuda_available``); it raises one
:class:`bridge.config.ConfigError` (the field and the fix) for the first problem it finds.
:mod:`bridge.train.checks.registry` lists them by section. Rules that need the trainer's
heavier modules import them when they run, so importing this module stays cheap.
"""

from __future__ import annotations

import os
from pathlib import Path

from bridge.config import (
    TOKENIZER_REQUIRED_FIELDS,
    CheckpointConfig,
    ConfigError,
    DistributedInitConfig,
    FinetuningDatasetConfig,
    GPTDatasetConfig,
    LoggerConfig,
    ModelConfigProtocol,
    NVRxStragglerDetectionConfig,
    PEFTProtocol,
    ProfilingConfig,
    RerunStateMachineConfig,
    RNGConfig,
    SamplesConfig,
    TokenizerConfig,
    TokenizerConfigProtocol,
    TrainingConfig,
    parse_split,
)
from bridge.train.checkpointing import CheckpointError, checkpoint_exists
from bridge.train.checkpointing.layout import validate_save_dir
from bridge.train.checks.launch import check_writable_directory
from bridge.train.data.datasets import (
    check_data_paths,
    dataset_prefixes,
    train_valid_test_num_samples,
)
from bridge.train.data.file_checks import DataFileError, check_indexed_dataset
from bridge.train.data.packing import check_packed_sequence_specs
from bridge.train.data.sft import check_finetuning_dataset
from bridge.train.data.split_checks import check_split_samples
from bridge.train.data.t5_datasets import T5DatasetConfig
from bridge.train.data.tokenizers import build_tokenizer, missing_tokenizer_package
from bridge.train.engine.launch_env import launch_environment
from bridge.train.models.layout_init import LayoutInitError, layout_independent_seed

__all__ = [
    "INDEX_BYTES_PER_SAMPLE",
    "checkpoint_directories_hold_runs",
    "data_files_are_sound",
    "data_is_sharded",
    "data_paths_exist",
    "data_splits_hold_samples",
    "dataset_index_fits_memory",
    "dataset_is_given",
    "dist_settings_are_implemented",
    "evaluation_has_validation_data",
    "finetuning_dataset_is_supported",
    "hf_tokenizer_files_exist",
    "load_directory_exists",
    "local_rank_is_the_launchers",
    "logger_directories_are_writable",
    "nsys_needs_cuda",
    "nvrx_needs_cuda",
    "peft_is_a_transform",
    "profiler_has_a_trace_directory",
    "rerun_state_machine_needs_cuda",
    "samples_can_be_generated",
    "save_directory_is_writable",
    "sharp_and_stream_priority_need_nccl",
    "tokenizer_can_be_built",
    "validation_sets_can_be_separate",
    "vocabulary_is_known",
]

Dataset = GPTDatasetConfig | FinetuningDatasetConfig | None
# What the dataset rules after dataset_is_given get: a section's rules stop at its first
# problem, so they never see a missing one.
GivenDataset = GPTDatasetConfig | FinetuningDatasetConfig
Tokenizer = TokenizerConfig | TokenizerConfigProtocol | None

#: Bytes megatron-core's GPT dataset index takes per sample: the shuffle index (int64) and
#: the sample index (two int64 per sample), rounded up.
INDEX_BYTES_PER_SAMPLE = 24


# ----------------------------------------------------------------------------------- model


def initialisation_is_possible(rng: RNGConfig, model: ModelConfigProtocol) -> None:
    """``rng.layout_independent_init=true`` only for providers it covers (see
    :mod:`bridge.train.models.layout_init`)."""
    try:
        layout_independent_seed(rng, model)
    except LayoutInitError as exc:
        location, _, detail = str(exc).partition(": ")
        raise ConfigError(location.split("=")[0], detail) from None


# ----------------------------------------------------------------------------------- train


def _validation_weight(dataset: Dataset) -> float | None:
    """Weight of the validation part of the data, or None when it cannot be told."""
    per_split = getattr(dataset, "blend_per_split", None)
    if per_split is not None:
        return 0.0 if len(per_split) < 2 or per_split[1] is None else 1.0
    split = getattr(dataset, "split", None)
    # The dataset section refuses a split that does not parse.
    return None if split is None else parse_split(split)[1]


def evaluation_has_validation_data(train: TrainingConfig, dataset: Dataset) -> None:
    """Evaluation switched on (``train.eval_iters`` > 0) needs a validation part of the data
    (``dataset.split`` with a validation weight, or a validation blend)."""
    if dataset is None or not train.eval_iters or train.skip_train:
        return
    weight = _validation_weight(dataset)
    if weight is None or weight > 0:
        return
    where = (
        "dataset.blend_per_split has no validation blend"
        if getattr(dataset, "blend_per_split", None) is not None
        else f"dataset.split={getattr(dataset, 'split', None)!r} gives the validation part weight 0"
    )
    raise ConfigError(
        "train.eval_iters",
        f"is {train.eval_iters}, so the run evaluates, but {where}; give the validation "
        "part data (e.g. dataset.split='98,2,0') or set train.eval_iters=0 to train "
        "without evaluation",
    )


def dataset_index_fits_memory(train: TrainingConfig) -> None:
    """A training length whose dataset index cannot be built on this machine is refused
    (``train.train_iters=10**23`` spins for hours in megatron-core's index building)."""
    if train.skip_train:  # validate() set the batch size and one of the lengths otherwise
        return
    samples = sum(train_valid_test_num_samples(train))
    try:
        memory: int | None = int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        memory = None
    needed = samples * INDEX_BYTES_PER_SAMPLE
    if memory is None or needed <= memory:
        return
    field = "train.train_samples" if train.train_samples is not None else "train.train_iters"
    value = train.train_samples if train.train_samples is not None else train.train_iters
    raise ConfigError(
        field,
        f"got {value}: that is {samples:.3g} samples, whose dataset index alone needs about "
        f"{needed / 2**30:.3g} GiB ({INDEX_BYTES_PER_SAMPLE} bytes per sample), more than "
        f"this machine's {memory / 2**30:.3g} GiB of memory; train for fewer iterations",
    )


# ------------------------------------------------------------------------------------ dist


def dist_settings_are_implemented(dist: DistributedInitConfig) -> None:
    """``dist`` settings of megatron-training that this trainer does not implement."""
    if dist.lazy_init:
        raise ConfigError(
            "dist.lazy_init",
            "got true; bridge-train sets up data parallelism itself and hands no finish "
            "function to an external DDP manager: set dist.lazy_init=false",
        )
    if dist.use_torch_fsdp2:
        raise ConfigError(
            "dist.use_torch_fsdp2",
            "got true; bridge-train does not shard with torch's FSDP2: set "
            "dist.use_torch_fsdp2=false and shard optimizer state with megatron's distributed "
            "optimizer (ddp.use_distributed_optimizer=true)",
        )


def local_rank_is_the_launchers(dist: DistributedInitConfig) -> None:
    """``dist.local_rank`` picks this process's GPU; where the launcher gives the process a
    local rank (torchrun, srun, or ``LOCAL_RANK`` exported with torch's variables) it must be
    that one: the config is the same on every process of a node, so another value would put
    them on one GPU. A bare launch, or torch's variables without ``LOCAL_RANK``, takes any."""
    launch = launch_environment()
    origin = launch.origins.get("LOCAL_RANK")
    if origin is None or dist.local_rank == launch.local_rank:
        return
    raise ConfigError(
        "dist.local_rank",
        f"got {dist.local_rank}, but this process is local rank {launch.local_rank} of its "
        f"launch (LOCAL_RANK from {origin}), and every process of a node reads the same "
        "value: remove dist.local_rank from the config (its default is the launcher's; a "
        "run_config.yaml saved by an earlier bridge-train holds rank 0's), or give each "
        "process its own GPU with CUDA_VISIBLE_DEVICES and "
        "dist.external_gpu_device_mapping=true",
    )


def sharp_and_stream_priority_need_nccl(dist: DistributedInitConfig, cuda_available: bool) -> None:
    """SHARP and high-priority communicator streams are NCCL features on CUDA."""
    for name, value, unset in (
        ("use_sharp", dist.use_sharp, "false"),
        ("high_priority_stream_groups", dist.high_priority_stream_groups, "null"),
    ):
        if not value or (cuda_available and dist.distributed_backend == "nccl"):
            continue
        where = "no GPU is available" if not cuda_available else "the backend is gloo"
        raise ConfigError(
            f"dist.{name}",
            f"needs NCCL on CUDA, and {where}; set dist.{name}={unset} (or run on GPUs with "
            "dist.distributed_backend='nccl')",
        )


# ----------------------------------------------------------------------- rerun, profiling


def rerun_state_machine_needs_cuda(
    rerun_state_machine: RerunStateMachineConfig, cuda_available: bool
) -> None:
    """megatron-core's rerun state machine (any mode but ``disabled``) needs CUDA."""
    mode = rerun_state_machine.rerun_mode
    if not cuda_available and mode != "disabled":
        raise ConfigError(
            "rerun_state_machine.rerun_mode",
            f"{mode!r} requires CUDA (megatron-core's rerun state machine saves and restores "
            "CUDA RNG state); use rerun_mode='disabled' on CPU",
        )


def nsys_needs_cuda(profiling: ProfilingConfig | None, cuda_available: bool) -> None:
    """Nsight Systems profiling brackets iterations with cudaProfilerStart/Stop."""
    if profiling is None or not profiling.use_nsys_profiler or cuda_available:
        return
    from bridge.train.loop.profiling import nsys_unavailable_reason

    raise ConfigError("profiling.use_nsys_profiler", str(nsys_unavailable_reason()))


def profiler_has_a_trace_directory(
    profiling: ProfilingConfig | None, logger: LoggerConfig | None, checkpoint: CheckpointConfig
) -> None:
    """The torch profiler writes its trace to ``logger.tensorboard_dir`` or
    ``<checkpoint.save>/profile``: one must be set."""
    if profiling is None or not profiling.use_pytorch_profiler:
        return
    from bridge.train.loop.profiling import profile_trace_dir

    if profile_trace_dir(logger, checkpoint) is None:
        raise ConfigError(
            "profiling.use_pytorch_profiler",
            "the trace needs a directory: set logger.tensorboard_dir (or checkpoint.save, "
            "which gets a 'profile' subdirectory)",
        )


def nvrx_needs_cuda(
    nvrx_straggler: NVRxStragglerDetectionConfig | None, cuda_available: bool
) -> None:
    """nvidia-resiliency-ext's straggler detection times CUDA kernels with CUPTI."""
    if nvrx_straggler is not None and nvrx_straggler.enabled and not cuda_available:
        raise ConfigError(
            "nvrx_straggler.enabled",
            "nvidia-resiliency-ext straggler detection requires CUDA and CUPTI; use "
            "straggler.log_straggler=true on CPU",
        )


# ------------------------------------------------------------------------------- tokenizer


def tokenizer_can_be_built(tokenizer: Tokenizer) -> None:
    """A ``tokenizer.tokenizer_type`` this installation can build (its optional package and
    the files it reads are there); ``tokenizer.hf_tokenizer_kwargs`` would be ignored."""
    if tokenizer is None:
        return
    if getattr(tokenizer, "hf_tokenizer_kwargs", None):
        raise ConfigError(
            "tokenizer.hf_tokenizer_kwargs",
            "is not used: bridge-train reads tokenizer.json with Hugging Face tokenizers, not "
            "AutoTokenizer.from_pretrained; remove it (add tokens with tokenizer.special_tokens)",
        )
    kind = tokenizer.tokenizer_type
    if kind is None:
        return
    message = missing_tokenizer_package(kind)
    if message is not None:
        raise ConfigError("tokenizer.tokenizer_type", message)
    # The files a file-based type reads must exist before the run starts (the null
    # tokenizer reads none; a Hugging Face directory is hf_tokenizer_files_exist's).
    skip = kind in ("NullTokenizer", "HuggingFaceTokenizer")
    for name in () if skip else TOKENIZER_REQUIRED_FIELDS.get(kind, ()):
        path = getattr(tokenizer, name, None)
        if path is not None and not Path(path).is_file():
            raise ConfigError(
                f"tokenizer.{name}",
                f"{str(path)!r} does not exist or is not a file; point it to the {kind} file",
            )


def vocabulary_is_known(tokenizer: Tokenizer, model: ModelConfigProtocol | None) -> None:
    """Without a ``tokenizer.tokenizer_type`` the token ids come from ``model.vocab_size``
    (a null tokenizer for mock data), which must then be known."""
    if (tokenizer is None or tokenizer.tokenizer_type is None) and getattr(
        model, "vocab_size", None
    ) is None:
        raise ConfigError(
            "tokenizer.tokenizer_type",
            "is not set and model.vocab_size is unknown; configure a tokenizer (e.g. "
            "tokenizer_type: ByteLevelTokenizer) or set model.vocab_size for mock data",
        )


def hf_tokenizer_files_exist(tokenizer: Tokenizer) -> None:
    """A Hugging Face tokenizer is read from a local directory (nothing is downloaded)."""
    if tokenizer is None or tokenizer.tokenizer_type != "HuggingFaceTokenizer":
        return
    model_path = tokenizer.tokenizer_model
    if model_path is not None and not Path(model_path).exists():
        raise ConfigError(
            "tokenizer.tokenizer_model",
            f"{model_path!r} does not exist; give a local directory with tokenizer.json "
            "(nothing is downloaded at run time)",
        )


# --------------------------------------------------------------------------------- dataset


def dataset_is_given(dataset: Dataset) -> None:
    """A training run reads data: the ``dataset`` section is required."""
    if dataset is None:
        raise ConfigError(
            "dataset",
            "required section is missing; add a 'dataset:' mapping (blend: [[<prefix>], null] "
            "for data from bridge-preprocess-data, or _target_: "
            "bridge.config.MockGPTDatasetConfig for mock data)",
        )


def data_is_sharded(dataset: GivenDataset) -> None:
    """Every data-parallel rank reads only its own part of each global batch."""
    if not getattr(dataset, "data_sharding", True):
        raise ConfigError(
            "dataset.data_sharding",
            "false is not supported: every data-parallel rank reads only its own part of "
            "each global batch (the samplers shard by construction); set it to true",
        )


def data_paths_exist(dataset: GivenDataset) -> None:
    """Every data file the section names exists."""
    try:
        check_data_paths(dataset)
    except FileNotFoundError as exc:
        text = str(exc)
        location, _, detail = text.partition(": ")
        raise ConfigError(location or "dataset", detail or text) from None


def data_files_are_sound(
    dataset: GivenDataset, tokenizer: Tokenizer, model: ModelConfigProtocol | None
) -> None:
    """Damaged ``.bin``/``.idx`` files and token ids beyond the vocabulary, named with the fix."""
    vocab = getattr(tokenizer, "vocab_size", None) or getattr(model, "vocab_size", None)
    prefixes = dataset_prefixes(dataset)
    if vocab is None and prefixes and tokenizer is not None:
        try:  # the tokenizer knows its size (byte-level: 256 + specials)
            vocab = int(build_tokenizer(tokenizer).vocab_size)
        except Exception:  # a tokenizer that cannot be built is reported when it is built
            vocab = None
    for field, prefix in prefixes:
        try:
            check_indexed_dataset(prefix, vocab, field)
        except DataFileError as exc:
            raise ConfigError(field, str(exc)) from None


def data_splits_hold_samples(dataset: GivenDataset, train: TrainingConfig) -> None:
    """Every train/validation/test split of ``.bin``/``.idx`` data holds a sample:
    megatron-core would loop forever building a split without a document (see
    :mod:`bridge.train.data.split_checks`)."""
    if not dataset_prefixes(dataset):
        return

    check_split_samples(
        dataset,
        train_valid_test_num_samples(train),
        gpt_samples=not isinstance(dataset, T5DatasetConfig),
    )


def validation_sets_can_be_separate(dataset: GivenDataset) -> None:
    """``dataset.multiple_validation_sets`` and ``full_validation`` where they can be
    honoured (:mod:`bridge.train.data.validation_sets`): GPT ``.bin``/``.idx`` data, each
    prefix of ``blend_per_split``'s validation entry (or of ``blend``, with a validation
    share in ``split``) one set. ``full_validation`` is their full pass, so it needs them.
    (The mimo recipe refuses the whole ``dataset`` section.)"""
    separate = bool(getattr(dataset, "multiple_validation_sets", None))
    if getattr(dataset, "full_validation", None) and not separate:
        raise ConfigError(
            "dataset.full_validation",
            "got true without dataset.multiple_validation_sets; the full pass is over each "
            "separate validation set: set dataset.multiple_validation_sets=true (one prefix "
            "in dataset.blend_per_split's validation entry gives one set) or "
            "dataset.full_validation=null",
        )
    if not separate:
        return
    per_split = getattr(dataset, "blend_per_split", None)
    unsupported = None
    # FinetuningDatasetConfig (SFT) has neither field: the config loader refuses them as
    # unknown fields of that section.
    if isinstance(dataset, T5DatasetConfig):
        unsupported = "T5 span-corruption data"
    elif getattr(dataset, "mock", False) or (
        getattr(dataset, "blend", None) is None and per_split is None
    ):
        unsupported = "mock data, which has no separate validation sets"
    elif getattr(dataset, "dataloader_type", None) == "external":
        unsupported = "dataset.dataloader_type=external, whose batches bridge-train does not build"
    elif not _validation_weight(dataset):
        unsupported = (
            "no validation split in dataset.split"
            if per_split is None
            else "no validation entry in dataset.blend_per_split"
        )
    if unsupported is not None:
        raise ConfigError(
            "dataset.multiple_validation_sets",
            f"got true with {unsupported}; separate validation sets are the prefixes of "
            "dataset.blend_per_split's validation entry, or of dataset.blend with a "
            "validation share in dataset.split (GPT .bin/.idx data): give them there, or "
            "set dataset.multiple_validation_sets=null",
        )


def finetuning_dataset_is_supported(dataset: Dataset, model: ModelConfigProtocol) -> None:
    """A ``FinetuningDatasetConfig`` the trainer can honour: files, ``dataset_kwargs``,
    loader settings, and packed-sequence settings against the model's attention."""
    if not isinstance(dataset, FinetuningDatasetConfig):
        return

    check_finetuning_dataset(dataset)
    check_packed_sequence_specs(dataset.packed_sequence_specs, dataset.seq_length, model)


# ------------------------------------------------------------------------------------ peft


def peft_is_a_transform(peft: PEFTProtocol | None, model: ModelConfigProtocol) -> None:
    """``peft`` is a transform the trainer can apply to this model."""
    if peft is None:
        return
    if not callable(peft):
        raise ConfigError(
            "peft",
            f"{type(peft).__qualname__} is not a PEFT transform: it must be callable as "
            "peft(model, training=True) -> model (e.g. _target_: bridge.train.peft.LoRA)",
        )
    if getattr(model, "sequence_parallel", False):
        raise ConfigError(
            "model.sequence_parallel",
            "adapters are applied without sequence parallelism; set it to false with peft",
        )


# --------------------------------------------------------------------------------- samples


def samples_can_be_generated(
    samples: SamplesConfig | None, model: ModelConfigProtocol, cuda_available: bool
) -> None:
    """Sample completions need a GPT-family model (what bridge-generate generates from) in
    a layout megatron-core's static inference can run with the training model."""
    if samples is None:
        return
    from bridge.train.models import GPTModelProvider, MambaProvider, T5ModelProvider

    if isinstance(model, (T5ModelProvider, MambaProvider)) or not isinstance(
        model, GPTModelProvider
    ):
        raise ConfigError(
            "samples",
            f"sample completions are generated from GPT-family models; "
            f"{type(model).__name__} does not generate (unset samples)",
        )
    # What megatron-core's static inference path cannot do with the training model.
    if model.pipeline_model_parallel_size > 1 and not cuda_available:
        raise ConfigError(
            "samples",
            "pipeline-parallel generation needs GPUs (megatron-core's inference broadcasts "
            "the last stage's logits with a CUDA-only check); unset samples on CPU",
        )
    if model.virtual_pipeline_model_parallel_size is not None:
        raise ConfigError(
            "samples",
            "megatron-core's inference runs one model chunk per rank; unset samples or "
            "model.virtual_pipeline_model_parallel_size",
        )
    if model.sequence_parallel:
        raise ConfigError(
            "samples",
            "megatron-core's static inference refuses model.sequence_parallel (it supports it "
            "for MoE layers only); unset samples or sequence_parallel",
        )
    if model.tensor_model_parallel_size > 1 and model.expert_model_parallel_size > 1:
        raise ConfigError(
            "samples",
            "with tensor and expert parallelism megatron-core's inference switches the "
            "model's sequence parallelism off and does not switch it back, which would "
            "change training; unset samples",
        )


# ------------------------------------------------------------------------------ checkpoint


def load_directory_exists(checkpoint: CheckpointConfig) -> None:
    """``checkpoint.load`` naming a directory that does not exist would train from scratch
    without a word (the first run of a resumable job, ``load == save``, is fine)."""
    load = checkpoint.load
    if load is None or Path(load).exists():
        return
    save = checkpoint.save
    if save is not None and Path(save).resolve() == Path(load).resolve():
        return
    raise ConfigError(
        "checkpoint.load",
        f"{str(load)!r} does not exist, so nothing would be loaded and the run would start "
        "from scratch; fix the path, or drop checkpoint.load (with checkpoint.save set a "
        "run resumes from its own save directory)",
    )


def checkpoint_directories_hold_runs(checkpoint: CheckpointConfig) -> None:
    """Checkpoint directories that cannot work.

    A ``checkpoint.save`` directory that holds anything but a bridge-train run (the check of
    :mod:`bridge.train.checkpointing`), applied to ``checkpoint.load`` too (unless it names
    one checkpoint directory);
    ``checkpoint.load`` without a checkpoint is refused with
    ``checkpoint.exit_on_missing_checkpoint``; ``checkpoint.pretrained_checkpoint`` must
    hold a checkpoint.
    """
    for field in ("save", "load"):
        path = getattr(checkpoint, field)
        if path is None or (field == "load" and checkpoint_exists(path)):
            continue
        try:
            validate_save_dir(path, f"checkpoint.{field}")
        except CheckpointError as exc:
            # The message's leading "checkpoint.<field>=" is the error's location here.
            detail = str(exc).removeprefix(f"checkpoint.{field}=")
            raise ConfigError(f"checkpoint.{field}", detail) from None
    load = checkpoint.load
    if load is not None and checkpoint.exit_on_missing_checkpoint and not checkpoint_exists(load):
        raise ConfigError(
            "checkpoint.load",
            f"{str(load)!r} holds no checkpoint and checkpoint.exit_on_missing_checkpoint is "
            "set; fix the path, or unset exit_on_missing_checkpoint to train from scratch",
        )
    pretrained = checkpoint.pretrained_checkpoint
    if pretrained is not None and not checkpoint_exists(pretrained):
        raise ConfigError(
            "checkpoint.pretrained_checkpoint",
            f"{str(pretrained)!r} holds no checkpoint; point it at the save directory of a "
            "bridge-train run",
        )


def save_directory_is_writable(checkpoint: CheckpointConfig) -> None:
    """``checkpoint.save`` can be created and written (a typo or a read-only mount fails at
    start, not after the first hour of training)."""
    if checkpoint.save is not None:
        check_writable_directory(checkpoint.save, "checkpoint.save")


# ---------------------------------------------------------------------------------- logger

# Directory fields of the logger section a run writes to.
_LOGGER_DIRECTORIES = ("tensorboard_dir", "wandb_save_dir", "comet_offline_dir")


def logger_directories_are_writable(logger: LoggerConfig) -> None:
    """Every output directory of the ``logger`` section (a required one) can be created and
    written."""
    for name in _LOGGER_DIRECTORIES:
        value = getattr(logger, name, None)
        if value is not None:
            check_writable_directory(value, f"logger.{name}")
