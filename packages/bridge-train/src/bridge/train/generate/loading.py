"""A bridge-train checkpoint as a model to generate from: :func:`load_generation_model`.

Any checkpoint bridge-train writes can be loaded: a pretraining or full-finetuning run's,
one ``bridge-convert import`` made from a Hugging Face model, or a LoRA run's adapter-only
checkpoint (its base weights come from the run's ``checkpoint.pretrained_checkpoint`` and
the adapters are merged into them after loading). What to build comes from the checkpoint's
``run_config.yaml``: the model (re-laid out for the tensor/pipeline-parallel sizes asked
for, with the saved padded vocabulary) and the tokenizer it was trained with.

Everything that can be checked without a process group is checked first, and each problem
is one :class:`~bridge.train.generate.errors.GenerationError` line: a missing directory, no
complete checkpoint, a missing or unreadable run config, a T5 or Mamba model, a tokenizer
that does not fit the model, LoRA adapters whose base is missing, a layout that does not fit
the processes. A damaged checkpoint (files that do not match their checksums) is refused by
the load.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bridge.config import (
    CheckpointConfig,
    ConfigContainer,
    ConfigError,
    TokenizerConfig,
    TokenizerConfigProtocol,
)
from bridge.train.checkpointing import CheckpointError, find_latest_checkpoint
from bridge.train.checkpointing.architecture import saved_run_config
from bridge.train.checkpointing.layout import (
    RUN_CONFIG_FILENAME,
    locate_checkpoint,
    one_lookup_per_launch,
)
from bridge.train.data.tokenizers import NullTokenizer, Tokenizer, build_tokenizer
from bridge.train.engine.initialize import destroy_distributed
from bridge.train.engine.launch_env import adopt_launch_environment
from bridge.train.engine.megatron import build_engine
from bridge.train.generate.errors import GenerationError
from bridge.train.generate.generator import TextGenerator
from bridge.train.loop.run_ends import load_run_checkpoint
from bridge.train.peft import apply_peft, merge_adapters
from bridge.train.state import TrainState

if TYPE_CHECKING:
    from bridge.train.models import GPTModelProvider

__all__ = [
    "GenerationModel",
    "generation_provider",
    "generation_tokenizer",
    "load_generation_model",
]


def _read_run_config(iteration_dir: Path) -> ConfigContainer:
    """The ``ConfigContainer`` saved with the checkpoint (the resume checks' reader), or a
    generation error naming the file.
    """
    try:
        run_config = saved_run_config(iteration_dir)
    except (ConfigError, OSError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise GenerationError(
            f"{iteration_dir / RUN_CONFIG_FILENAME} cannot be read: {first}"
        ) from None
    if run_config is None:
        raise GenerationError(
            f"{iteration_dir} has no {RUN_CONFIG_FILENAME}; the model and tokenizer it was "
            "trained with cannot be known"
        )
    return run_config


def _check_family(provider: Any, where: Path) -> GPTModelProvider:
    """``provider``, refused unless it is a GPT-family provider."""
    from bridge.train.models import GPTModelProvider, MambaProvider, T5ModelProvider

    if isinstance(provider, T5ModelProvider):
        raise GenerationError(
            f"{where} holds a T5 model (encoder-decoder); bridge-generate generates from "
            "GPT-family (decoder-only) models only"
        )
    if isinstance(provider, MambaProvider):
        raise GenerationError(
            f"{where} holds a hybrid Mamba model; bridge-generate generates from GPT-family "
            "models only (the portable Mamba layers keep no inference state)"
        )
    if not isinstance(provider, GPTModelProvider):
        raise GenerationError(
            f"{where} holds a {type(provider).__name__} model; bridge-generate generates from "
            "GPT-family providers (bridge.train.models.GPTModelProvider)"
        )
    return provider


def generation_tokenizer(
    section: TokenizerConfig | TokenizerConfigProtocol | None,
    model_vocab_size: int,
    where: Path,
    tokenizer_model: str | os.PathLike[str] | None = None,
) -> Tokenizer:
    """The tokenizer the run was trained with (its ``tokenizer`` section, or the null
    tokenizer of mock data when it has none), checked against the model's vocabulary.

    Args:
        section: The checkpoint's ``tokenizer`` section.
        model_vocab_size: The model's ``vocab_size``.
        where: The checkpoint (for messages).
        tokenizer_model: Use this ``tokenizer.tokenizer_model`` instead of the saved one (a
            tokenizer directory or file that moved).

    Raises:
        GenerationError: The tokenizer cannot be built, or it has more ids than the model
            embeds, or its end-of-document id is outside the model's vocabulary.
    """

    null = section is None or getattr(section, "tokenizer_type", None) is None
    if tokenizer_model is not None:
        if section is None or null:
            raise GenerationError(
                f"--tokenizer: {where} was trained without a tokenizer section (mock data and "
                "the null tokenizer); there is no tokenizer file to replace"
            )
        section = copy.copy(section)
        section.tokenizer_model = str(tokenizer_model)
    try:
        tokenizer = (
            NullTokenizer(model_vocab_size) if section is None or null else build_tokenizer(section)
        )
    except (ImportError, OSError, ValueError) as exc:
        raise GenerationError(
            f"the tokenizer of {where} (run_config.yaml tokenizer section) cannot be built: "
            f"{str(exc).splitlines()[0]}; pass --tokenizer PATH if it moved"
        ) from None
    size, eod = int(tokenizer.vocab_size), int(tokenizer.eod)
    if size > model_vocab_size or not 0 <= eod < model_vocab_size:
        raise GenerationError(
            f"tokenizer mismatch: the tokenizer ({type(tokenizer).__name__}, {size} ids, "
            f"end-of-document id {eod}) does not fit the model of {where}, which embeds "
            f"{model_vocab_size} ids; use the tokenizer the model was trained with"
        )
    return tokenizer


def generation_provider(
    provider: Any, tensor_model_parallel_size: int, pipeline_model_parallel_size: int
) -> Any:
    """A copy of the run's model ``provider`` laid out for generation, with the saved padded
    vocabulary.

    The embedding's rows are ``ceil(vocab / (make_vocab_size_divisible_by * TP)) * ...`` of
    the saved layout; the copy keeps ``make_vocab_size_divisible_by * TP`` so that a
    checkpoint saved at one TP loads at another (dist_checkpointing reshards the rest).

    Raises:
        GenerationError: The sizes do not divide the saved padding or the model.
    """
    tp, pp = int(tensor_model_parallel_size), int(pipeline_model_parallel_size)
    multiple = int(provider.make_vocab_size_divisible_by) * int(provider.tensor_model_parallel_size)
    if tp < 1 or multiple % tp:
        raise GenerationError(
            f"--tp {tp}: the checkpoint's vocabulary is padded to a multiple of {multiple}, "
            f"which {tp} tensor-parallel ranks cannot split evenly; use a divisor of {multiple}"
        )
    if pp < 1 or provider.num_layers % pp:
        raise GenerationError(
            f"--pp {pp} does not divide the model's {provider.num_layers} layers "
            "(model.pipeline_model_parallel_size)"
        )
    out = copy.copy(provider)
    out.make_vocab_size_divisible_by = multiple // tp
    out.tensor_model_parallel_size = tp
    out.pipeline_model_parallel_size = pp
    out.virtual_pipeline_model_parallel_size = None
    out.sequence_parallel = False
    out.context_parallel_size = 1
    out.expert_model_parallel_size = 1
    out.expert_tensor_parallel_size = None
    # The weights come from the checkpoint: drawing random ones first is wasted time.
    out.perform_initialization = False
    if pp > 1 and out.pipeline_dtype is None:
        out.pipeline_dtype = out.params_dtype
    out.finalize()
    return out


@dataclass
class GenerationModel:
    """A loaded checkpoint, ready to generate from.

    Attributes:
        model: The model chunks (one per rank), in eval mode, LoRA adapters merged.
        tokenizer: The tokenizer the run was trained with.
        provider: The model provider it was built from (this process's layout).
        run_config: The checkpoint's ``ConfigContainer``.
        checkpoint: The ``iter_*`` directory loaded.
        iteration: Its training iteration.
        adapters_merged: Whether LoRA adapters were merged into the base weights.
        close: Tears down what loading started (process group, parallel state, CUDA
            emulation); call it once generation is over.
    """

    model: list[Any]
    tokenizer: Any
    provider: Any
    run_config: Any
    checkpoint: Path
    iteration: int
    adapters_merged: bool
    close: Callable[[], None]

    def generator(self, max_batch_size: int = 8) -> Any:
        """A :class:`~bridge.train.generate.generator.TextGenerator` over this model."""

        return TextGenerator(
            self.model,
            self.tokenizer,
            max_sequence_length=int(self.provider.seq_length),
            max_batch_size=max_batch_size,
        )


# The checks, the base lookup and the load resolve the same directories: each is looked up
# once, as a training launch does.
@one_lookup_per_launch()
def load_generation_model(
    ckpt_dir: str | os.PathLike[str],
    *,
    tensor_model_parallel_size: int | None = None,
    pipeline_model_parallel_size: int = 1,
    tokenizer_model: str | os.PathLike[str] | None = None,
) -> GenerationModel:
    """Load a checkpoint for generation (every rank calls it; see the module docstring).

    Starts ``torch.distributed`` (one process bare, the launcher's ranks under ``torchrun``)
    and megatron's parallel state on the trainer's megatron engine (on a machine without
    CUDA under the CUDA emulation); :attr:`GenerationModel.close` ends them.

    Args:
        ckpt_dir: A checkpoint directory (its newest checkpoint) or an ``iter_*`` directory.
        tensor_model_parallel_size: Tensor-parallel size (default: every process).
        pipeline_model_parallel_size: Pipeline-parallel size (GPU only: see
            ``docs/generate.md``).
        tokenizer_model: Replaces the saved ``tokenizer.tokenizer_model``.

    Returns:
        The loaded model.

    Raises:
        GenerationError: See the module docstring.
    """

    try:
        _, iteration_dir = locate_checkpoint(ckpt_dir)
    except CheckpointError as exc:
        raise GenerationError(str(exc)) from None
    run_config = _read_run_config(iteration_dir)
    saved_model = _check_family(run_config.model, iteration_dir)
    assert saved_model.vocab_size is not None  # a saved run config is a validated one
    tokenizer = generation_tokenizer(
        run_config.tokenizer, saved_model.vocab_size, iteration_dir, tokenizer_model
    )
    # A LoRA run's checkpoint holds the adapters only: their base must be there.
    peft = run_config.peft
    saved = run_config.checkpoint
    base = saved.pretrained_checkpoint if peft is not None and saved is not None else None
    if peft is not None and not base:
        raise GenerationError(
            f"{iteration_dir} holds LoRA adapters only, and its run config names no base model "
            "(checkpoint.pretrained_checkpoint); the adapters cannot be used without it"
        )
    if base and find_latest_checkpoint(base) is None:
        raise GenerationError(
            f"{iteration_dir} holds LoRA adapters only, and their base model "
            f"checkpoint.pretrained_checkpoint={base} "
            f"{'holds no checkpoint' if Path(base).exists() else 'does not exist'}; restore "
            "the base checkpoint there"
        )
    world = adopt_launch_environment().world_size  # torchrun's, srun's or 1
    pp = int(pipeline_model_parallel_size)
    tp = int(tensor_model_parallel_size) if tensor_model_parallel_size else max(world // pp, 1)
    if tp * pp != world:
        raise GenerationError(
            f"--tp {tp} x --pp {pp} = {tp * pp} model-parallel ranks, but {world} processes "
            f"were launched; launch {tp * pp} (generation has no data parallelism)"
        )
    if pp > 1 and not torch.cuda.is_available():
        raise GenerationError(
            f"--pp {pp} (model.pipeline_model_parallel_size): megatron-core's inference sends "
            "the logits from the last pipeline stage with a CUDA-only check "
            "(megatron/core/inference/communication_utils.py); pipeline-parallel generation "
            "needs GPUs, on CPU use --tp"
        )
    provider = generation_provider(run_config.model, tp, pp)
    engine = build_engine()
    # No dist section: the backend is the machine's (nccl with CUDA, gloo without).
    engine.initialize_distributed(provider, None, run_config.rng)
    try:
        hooks = [] if peft is None else [lambda chunks: apply_peft(peft, chunks)]
        model = engine.setup_model(provider, wrap_with_ddp=False, pre_wrap_hooks=hooks)
        checkpoint = CheckpointConfig(
            load=str(iteration_dir),
            pretrained_checkpoint=base,
            load_optim=False,
            load_rng=False,
        )
        # The saved model settings: the load compares them with the checkpoint's (this
        # process's provider differs only in its layout, which the load reshards).
        try:
            iteration = load_run_checkpoint(
                checkpoint,
                TrainState(),
                model,
                None,
                None,
                {},
                model_config=run_config.model,
                peft=peft,
                announce=False,  # bridge-generate reports the checkpoint itself
            )
            if peft is not None:
                merge_adapters(model)
        except CheckpointError as exc:
            raise GenerationError(str(exc).splitlines()[0]) from None
        for chunk in model:
            chunk.eval()
    except BaseException:
        destroy_distributed()
        raise
    return GenerationModel(
        model=model,
        tokenizer=tokenizer,
        provider=provider,
        run_config=run_config,
        checkpoint=iteration_dir,
        iteration=int(iteration),
        adapters_merged=peft is not None,
        close=destroy_distributed,
    )
