"""Hugging Face model directory -> bridge-train checkpoint.

How the layout is written: the model is built once on one process (tensor and pipeline
parallel size 1, but with the vocabulary padded for the requested tensor-parallel size) on
the meta device, and saved through bridge-train's own ``write_checkpoint`` with a save
strategy that produces each parameter from the safetensors files when the checkpoint
writer asks for it (:mod:`bridge.train.convert.streaming`). A ``torch_dist`` checkpoint
stores every tensor with its global shape and sharding, and dist_checkpointing reshards at
load, so this checkpoint loads into any TP x PP layout whose padded vocabulary matches (the
one given at import; the ``run_config.yaml`` written with it carries that layout). Peak
memory is about one parameter (its Hugging Face sources, then the assembled tensor and the
piece being written), not the model; ``benchmarks/hf_conversion.py`` measures it.

The checkpoint directory::

    CKPT_DIR/
      latest_checkpointed_iteration.txt       "0"
      iter_0000000/                           the weights (model only), run_config.yaml
      hf/                                     config.json, tokenizer and generation files of
                                              the source, bridge_import.json (for export)
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bridge.config import CheckpointConfig, ConfigContainer, GPTDatasetConfig, TokenizerConfig
from bridge.train.checkpointing import init_checkpointing_context, write_checkpoint
from bridge.train.checkpointing.save import SUPPLIED_SAVE_STRATEGY
from bridge.train.convert._runtime import (
    refuse_nonempty,
    single_process_megatron,
    single_rank_copy,
    staged,
)
from bridge.train.convert.model_weights import build_on_meta
from bridge.train.convert.source import HFSource, side_files
from bridge.train.convert.streaming import StreamingSaveStrategy
from bridge.train.models.families import ConversionError, provider_from_hf_config
from bridge.train.recipes import recipe_path
from bridge.train.state import TrainState

__all__ = ["HF_SUBDIR", "IMPORT_RECORD", "import_hf_checkpoint"]

HF_SUBDIR = "hf"
IMPORT_RECORD = "bridge_import.json"

Progress = Callable[[str], None]


def _tokenizer_vocab(hf_dir: Path) -> int | None:
    file = hf_dir / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConversionError(
            "reading tokenizer.json needs the 'tokenizers' package: pip install bridge-train[hf]"
        ) from None
    try:
        return int(Tokenizer.from_file(str(file)).get_vocab_size(with_added_tokens=True))
    except Exception as exc:  # the tokenizers library raises its own exception type
        raise ConversionError(f"{file} cannot be read: {exc}") from None


def _recipe(provider: Any, out: Path, tokenizer_dir: Path | None) -> Any:
    """The run config saved with the checkpoint: a finetuning starting point."""

    recipe = ConfigContainer.from_yaml(recipe_path("tiny_gpt"))
    recipe.model = provider
    if tokenizer_dir is not None:
        recipe.tokenizer = TokenizerConfig(
            tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tokenizer_dir)
        )
    else:
        recipe.tokenizer = TokenizerConfig(
            tokenizer_type="NullTokenizer", vocab_size=int(provider.vocab_size)
        )
    recipe.checkpoint = CheckpointConfig(pretrained_checkpoint=str(out))
    if isinstance(recipe.dataset, GPTDatasetConfig):  # the recipe's mock data
        recipe.dataset.sequence_length = provider.seq_length
    return recipe


def import_hf_checkpoint(
    hf_dir: str | os.PathLike[str],
    ckpt_dir: str | os.PathLike[str],
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    make_vocab_size_divisible_by: int = 128,
    seq_length: int | None = None,
    progress: Progress | None = None,
) -> Path:
    """Convert a local Hugging Face model directory into a bridge-train checkpoint.

    The result is a normal checkpoint directory: ``checkpoint.pretrained_checkpoint`` loads
    it (model weights, iteration 0) into a model built from its ``run_config.yaml``
    (``CKPT_DIR/iter_0000000/run_config.yaml``, which is also a runnable finetuning recipe:
    the imported model, its tokenizer, mock data).

    Args:
        hf_dir: Directory with ``config.json``, safetensors weights (one file, or shards
            with ``model.safetensors.index.json``) and optionally tokenizer files.
        ckpt_dir: New (or empty) directory to write.
        tensor_model_parallel_size: Tensor-parallel size the model will be trained with
            (decides the vocabulary padding and is validated against the architecture).
        pipeline_model_parallel_size: Pipeline-parallel size it will be trained with.
        expert_model_parallel_size: Expert-parallel size it will be trained with (MoE
            families; validated against the number of experts).
        make_vocab_size_divisible_by: Vocabulary padding per tensor-parallel rank.
        seq_length: Training sequence length recorded in the run config (see
            :func:`~bridge.train.convert.provider_from_hf_config`).
        progress: Called with a short message per converted tensor group.

    Returns:
        The checkpoint directory.

    Raises:
        ConversionError: Unsupported architecture, missing shard or tensor, shape mismatch,
            a tokenizer larger than the embedding, a layout the model does not divide into,
            or an existing non-empty ``ckpt_dir``.
    """

    hf = Path(hf_dir)
    out = Path(ckpt_dir).resolve()
    report = progress or (lambda message: None)
    source = HFSource(hf)
    target = provider_from_hf_config(
        source.config,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        seq_length=seq_length,
    )
    # A tensor-parallel size that splits key/value heads (the pipeline and expert sizes are
    # checked by provider_from_hf_config).
    tp, groups = target.tensor_model_parallel_size, target.num_query_groups
    if groups % tp:
        raise ConversionError(
            f"--tp {tp} does not divide the model's {groups} key/value heads "
            "(num_key_value_heads); megatron-core needs whole query groups on every "
            "tensor-parallel rank"
        )
    refuse_nonempty(out, "import into a new directory (nothing there is overwritten)")
    tokenizer_vocab = _tokenizer_vocab(hf)
    if tokenizer_vocab is not None and tokenizer_vocab > target.vocab_size:
        raise ConversionError(
            f"{hf / 'tokenizer.json'} has {tokenizer_vocab} tokens but the model's embedding "
            f"has {target.vocab_size} rows (config.json vocab_size); token ids would fall "
            "outside the embedding: use the tokenizer this model was trained with"
        )
    mappings = source.mappings(target.padded_vocab_size)
    skipped = source.skipped()
    if skipped:
        report(
            f"skipping {len(skipped)} tensor(s) outside the {source.family.name} language "
            f"model (first {skipped[0]!r})"
        )

    single = single_rank_copy(target)
    tokenizer_dir = out / HF_SUBDIR if tokenizer_vocab is not None else None
    with staged(out, ".importing") as staging:
        with single_process_megatron(single):
            model, params = build_on_meta(single)
            source.check_shapes(mappings, params)
            by_name = {mapping.megatron: mapping for mapping in mappings}
            left = sorted(set(params) - set(by_name))
            if left:
                raise ConversionError(f"internal: no Hugging Face source for {left[0]!r}")
            done: set[str] = set()

            def produce(name: str) -> torch.Tensor:
                tensor = source.megatron_tensor(by_name[name])
                if name not in done:
                    done.add(name)
                    report(f"[{len(done)}/{len(mappings)}] {name}")
                return tensor

            save_config = CheckpointConfig(
                save=str(staging), save_optim=False, save_rng=False, async_save=False
            )
            context = init_checkpointing_context(save_config)
            context[SUPPLIED_SAVE_STRATEGY] = StreamingSaveStrategy(model, produce)
            report(f"writing {out}")
            write_checkpoint(
                save_config,
                TrainState(),
                [model],
                None,
                None,
                run_config=_recipe(target, out, tokenizer_dir),
                checkpointing_context=context,
            )
            tensor_names = source.names()
            source.close()
            del model, params
        (staging / HF_SUBDIR).mkdir()
        for item in side_files(hf):  # config, tokenizer, generation config: all but weights
            shutil.copy2(item, staging / HF_SUBDIR / item.name)
        record = {
            "source": str(hf.resolve()),
            "model_type": source.config["model_type"],
            "family": source.family.name,
            "prefix": source.prefix,
            "dtype": str(source.dtype).removeprefix("torch."),
            "tensor_names": tensor_names,
            "tensor_model_parallel_size": tensor_model_parallel_size,
            "pipeline_model_parallel_size": pipeline_model_parallel_size,
        }
        (staging / HF_SUBDIR / IMPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return out
