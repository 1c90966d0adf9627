"""One-process megatron runtime and output directories for conversions (internal)."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
from megatron.core import parallel_state

from bridge.config import DistributedInitConfig
from bridge.train.engine.initialize import destroy_distributed, initialize_distributed
from bridge.train.models.families import ConversionError

__all__ = ["refuse_nonempty", "single_process_megatron", "single_rank_copy", "staged"]


def refuse_nonempty(out: Path, advice: str) -> None:
    """Refuse an output path that exists and is not an empty directory (nothing there is
    overwritten); ``advice`` ends the message."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConversionError(f"{out} already exists and is not empty; {advice}")


@contextlib.contextmanager
def staged(out: Path, suffix: str) -> Iterator[Path]:
    """A fresh ``out`` + ``suffix`` directory to write into, renamed to ``out`` (absent or
    empty: :func:`refuse_nonempty`) when the block completes and removed when it fails, so
    ``out`` appears only complete."""
    staging = out.with_name(out.name + suffix)
    shutil.rmtree(staging, ignore_errors=True)  # our own leftover of an interrupted run
    staging.mkdir(parents=True)
    try:
        yield staging
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def single_rank_copy(provider: Any) -> Any:
    """``provider`` laid out on one rank with the same padded vocabulary.

    The tensors a checkpoint stores are global (dist_checkpointing reshards them at load),
    but the vocabulary padding depends on the tensor-parallel size: the copy pads to
    ``make_vocab_size_divisible_by * TP`` of the original, so its embedding has exactly the
    rows a model of the original layout has.
    """

    single = copy.copy(provider)
    single.make_vocab_size_divisible_by = (
        provider.make_vocab_size_divisible_by * provider.tensor_model_parallel_size
    )
    single.tensor_model_parallel_size = 1
    single.pipeline_model_parallel_size = 1
    single.expert_model_parallel_size = 1
    single.expert_tensor_parallel_size = 1
    single.virtual_pipeline_model_parallel_size = None
    single.sequence_parallel = False
    single.parallel_output = False
    single.finalize()
    return single


@contextlib.contextmanager
def single_process_megatron(provider: Any) -> Iterator[None]:
    """Megatron's parallel state for one rank (TP=PP=1), created and torn down here.

    Reuses an existing one-rank default process group; refuses a larger one (conversions
    run in one process and the checkpoint is resharded at load). A mixture-of-experts model
    is set up as the megatron engine sets it up (its MoE layers ask for the CUDA device, which
    :func:`core_utils.cuda_emulation` answers on a machine without one).
    """

    if dist.is_initialized() and dist.get_world_size() != 1:
        raise ConversionError(
            f"Hugging Face conversion runs in one process, but torch.distributed has "
            f"{dist.get_world_size()} ranks; run bridge-convert without torchrun"
        )
    if parallel_state.model_parallel_is_initialized():
        raise ConversionError(
            "megatron's parallel state is already initialised in this process; run the "
            "conversion in a fresh process (bridge-convert)"
        )

    initialize_distributed(
        provider,
        DistributedInitConfig(distributed_backend="gloo"),
        # megatron-core's MoE layers allocate on the "current CUDA device": on CPU they run
        # under the engine's CUDA emulation; dense models need none to convert.
        emulate_cuda=bool(getattr(provider, "num_moe_experts", None)),
    )
    try:
        yield
    finally:
        # The parallel state, the emulation, and the process group when it was created here.
        destroy_distributed()
