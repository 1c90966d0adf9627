"""bridge-train checkpoint -> Hugging Face model directory.

The checkpoint (any tensor/pipeline-parallel layout it was saved with) is read one parameter
at a time into a one-process model built on the meta device from its ``run_config.yaml``
(dist_checkpointing reshards), and each parameter is written as soon as it is read, with
the Hugging Face names and in the source's dtype, into safetensors shards whose headers are
computed first: peak memory is about one parameter, not the model. A LoRA run is loaded
whole instead (its adapters are merged into the base weights) and written shard by shard.

The Hugging Face ``config.json``, tokenizer and generation files come from the ``hf/``
directory an import left (found through ``checkpoint.pretrained_checkpoint`` of a finetuned
run's config), or from ``hf_config_dir``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace, nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
)
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from torch.distributed.checkpoint.api import CheckpointException

from bridge.config import (
    CheckpointConfig,
    ConfigError,
    PEFTProtocol,
    TokenizerConfig,
    TokenizerConfigProtocol,
)
from bridge.train.checkpointing import CheckpointError, restore_checkpoint
from bridge.train.checkpointing.architecture import saved_run_config
from bridge.train.checkpointing.integrity import checkpoint_problems
from bridge.train.checkpointing.layout import (
    MARKER_FILENAME,
    RUN_CONFIG_FILENAME,
    locate_checkpoint,
    one_lookup_per_launch,
)
from bridge.train.convert._runtime import (
    refuse_nonempty,
    single_process_megatron,
    single_rank_copy,
    staged,
)
from bridge.train.convert.importer import HF_SUBDIR, IMPORT_RECORD
from bridge.train.convert.model_weights import build_on_meta, named_weights, write_hf_weights
from bridge.train.convert.source import side_files
from bridge.train.models.families import (
    ConversionError,
    HFFamily,
    architecture_mismatches,
    family_for,
    match_family,
    provider_from_hf_config,
    read_hf_config,
    torch_dtype_of,
)
from bridge.train.peft import apply_peft, merge_adapters
from bridge.train.peft.checkpoint import load_peft_checkpoints
from bridge.train.state import TrainState

__all__ = ["export_hf_checkpoint", "load_model_for_export", "write_side_files"]


def _hf_files(
    provider: Any,
    tokenizer: TokenizerConfig | TokenizerConfigProtocol | None,
    root: Path,
    pretrained: str | None,
    hf_config_dir: str | os.PathLike[str] | None,
    report: Callable[[str], None],
) -> tuple[HFFamily, dict[str, Any], str, dict[str, Any], Path | None]:
    """What an export writes besides the weights: ``(family, config of the model the
    mappings read, tensor-name prefix, config.json to write, directory of the side files to
    copy or None)``.

    The source's ``config.json`` and tokenizer are in ``hf_config_dir``, else in the ``hf/``
    of the checkpoint or of the run's imported ``pretrained`` checkpoint. Without one (a
    model trained from scratch) the first family whose preset reproduces the model section
    writes the config, and the run's Hugging Face tokenizer directory is copied.

    Raises:
        ConversionError: The given config describes another model, or (from scratch) no
            family matches the provider.
    """
    if hf_config_dir is not None:
        if not (Path(hf_config_dir) / "config.json").is_file():
            raise ConversionError(f"--hf-config {hf_config_dir} has no config.json")
        candidates = [Path(hf_config_dir)]
    else:
        candidates = [root / HF_SUBDIR, *([Path(pretrained) / HF_SUBDIR] if pretrained else [])]
    side = next((path for path in candidates if (path / "config.json").is_file()), None)
    if side is None:
        family, config = match_family(provider)
        report(
            f"no Hugging Face config.json came with this checkpoint: writing a "
            f"{family.name} ({family.architecture}) config.json from its model section"
        )
        model = getattr(tokenizer, "tokenizer_model", None)
        hf_tokenizer = getattr(tokenizer, "tokenizer_type", None) == "HuggingFaceTokenizer"
        files = Path(str(model)) if hf_tokenizer and model and Path(str(model)).is_dir() else None
        return family, config, family.hf_prefixes[0], config, files
    source = read_hf_config(side)
    family = family_for(source)
    reference = provider_from_hf_config(
        source, make_vocab_size_divisible_by=provider.make_vocab_size_divisible_by
    )
    found = architecture_mismatches(provider, reference)
    if found:
        name, (mine, theirs) = next(iter(found.items()))
        raise ConversionError(
            f"{side / 'config.json'} describes another model: {name}={theirs!r} there, "
            f"{mine!r} in the checkpoint"
        )
    record_file = side / IMPORT_RECORD
    record = json.loads(record_file.read_text()) if record_file.is_file() else {}
    written, prefix = family.export_config(source, record.get("prefix"))
    return family, family.text_config(source), prefix, written, side


def write_side_files(
    out: Path,
    family: HFFamily,
    config: dict[str, Any],
    files_dir: Path | None,
    dtype: torch.dtype,
    *,
    copy_config: bool,
) -> None:
    """``config.json``, ``generation_config.json`` and the tokenizer of an export.

    Args:
        out: The output directory.
        family: The exported family.
        config: The ``config.json`` to write.
        files_dir: The source's side files (a Hugging Face directory or an import's
            ``hf/``) or, from scratch, the run's tokenizer directory: every file but weights
            and ``config.json`` is copied; ``None``: no tokenizer.
        dtype: The dtype the weights were written in (recorded in ``config.json``).
        copy_config: Copy the source's ``config.json`` byte for byte when it is the one
            to write.
    """
    source = files_dir / "config.json" if files_dir is not None else None
    for item in side_files(files_dir) if files_dir is not None else []:
        if item.name not in (IMPORT_RECORD, "config.json"):
            shutil.copy2(item, out / item.name)
    if (
        copy_config
        and source is not None
        and source.is_file()
        and read_hf_config(source.parent) == config
        and torch_dtype_of(config) == dtype
    ):
        shutil.copy2(source, out / "config.json")
    else:
        name = str(dtype).removeprefix("torch.")
        written = {**config, "dtype": name}
        if "torch_dtype" in written:
            written["torch_dtype"] = name
        (out / "config.json").write_text(json.dumps(written, indent=2) + "\n")
    if not (out / "generation_config.json").is_file():
        generation = family.generation_config(config)
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def load_model_for_export(
    iteration_dir: Path,
    single: Any,
    *,
    peft: PEFTProtocol | None = None,
    pretrained_checkpoint: str | None = None,
    merge: bool = True,
) -> Any:
    """Build ``single`` (a one-rank provider) and load the checkpoint into it.

    A run with a ``peft`` section saved adapters only: the base weights come from its
    ``pretrained_checkpoint``, the adapters from ``iteration_dir``, and with
    ``merge`` they are folded into the base weights (``bridge.train.peft.merge_adapters``),
    leaving a plain model. Needs megatron's parallel state (one rank).
    """

    model = single.provide(pre_process=True, post_process=True)
    if peft is not None and not pretrained_checkpoint:
        raise ConversionError(
            f"{iteration_dir} holds adapters (the run has a peft section) but its run config "
            "names no checkpoint.pretrained_checkpoint to take the base weights from"
        )
    checkpoint = CheckpointConfig(
        load=str(iteration_dir),
        pretrained_checkpoint=str(pretrained_checkpoint) if peft is not None else None,
        finetune=peft is None,
        load_optim=False,
        load_rng=False,
    )
    try:
        if peft is None:
            restore_checkpoint(checkpoint, TrainState(), [model], None, None)
            return model
        (model,) = apply_peft(peft, [model])
        load_peft_checkpoints(checkpoint, TrainState(), [model], None, None, {})
    except CheckpointError as exc:
        raise ConversionError(str(exc).splitlines()[0]) from None
    return merge_adapters(model) if merge else model


def _whole_axes(item: Any) -> Any:
    """``item`` with its prepended (stacked-layer) axes as ordinary axes of length 1.

    megatron turns a tensor with prepended axes into a torch ``ShardedTensor`` that must
    list every layer's chunk as local in a one-process load; as an ordinary chunk of the
    same global tensor it is read alone (the stored chunks are the same).
    """

    count = item.prepend_axis_num
    if not count:
        return item
    shape = (1,) * count + tuple(item.local_shape)
    return dataclasses.replace(
        item, data=item.data.reshape(shape), local_shape=shape, prepend_axis_num=0
    )


def _stream_export(
    iteration_dir: Path,
    single: Any,
    mappings: list[Any],
    out_dtype: torch.dtype,
    staging: Path,
    max_shard_bytes: int,
    report: Callable[[str], None],
) -> tuple[list[Path], int]:
    """Load the checkpoint one parameter at a time and write each as it is loaded.

    The model is built on the meta device for its sharded state dict (keys, shapes,
    sharding); for each parameter, dist_checkpointing loads only that parameter's entries
    into a real tensor, which is converted and written out before the next is loaded.
    """

    # The checks a load makes first: the saved files match the marker's checksums (a
    # checkpoint saved before checksums existed has nothing to check against).
    problems = checkpoint_problems(iteration_dir, share=False)
    if problems:
        name, what = min(problems.items())
        state = "cannot be verified" if name == MARKER_FILENAME else "is damaged"
        raise ConversionError(
            f"{iteration_dir} {state}: {what}; restore it from a copy, or export another "
            "checkpoint (give its iter_* directory)"
        )
    model, params = build_on_meta(single)
    name_of = {id(param): name for name, param in params.items()}
    entries: dict[str, dict[str, Any]] = {}
    for key, item in model.sharded_state_dict().items():
        if not isinstance(item, (ShardedTensor, ShardedTensorFactory)):
            continue
        data = item.data
        root = data._base if data._base is not None else data
        if root.is_meta and id(root) in name_of:
            entries.setdefault(name_of[id(root)], {})[key] = item
    strategy = TorchDistLoadShardedStrategy()

    def loaded() -> Iterator[torch.Tensor]:
        for mapping in mappings:
            meta = params[mapping.megatron]
            items = entries.get(mapping.megatron)
            if not items:
                raise ConversionError(f"internal: {mapping.megatron} has no checkpoint entry")
            real = torch.empty(meta.shape, dtype=meta.dtype)
            template: dict[str, Any] = {}
            for key, item in items.items():
                data = item.data
                view = real.as_strided(data.shape, data.stride(), data.storage_offset())
                template[key] = dataclasses.replace(item, data=view)
            apply_factories(template)  # a gated fc1's halves: views of ``real`` too
            template = dict_list_map_outplace(_whole_axes, template)
            targets = list(nested_values(template))
            try:
                # One layer's parameter is part of a key stacked over the layers: the
                # whole-key access check does not apply to a partial load.
                result = dist_checkpointing.load(
                    template, str(iteration_dir), strategy, validate_access_integrity=False
                )
            except (CheckpointException, CheckpointingException) as exc:
                raise ConversionError(f"loading {iteration_dir} failed: {exc}") from None
            values = list(nested_values({key: result[key] for key in template}))
            with torch.no_grad():
                for target, value in zip(targets, values, strict=True):
                    if value.data_ptr() != target.data.data_ptr():  # loaded in place, or copied
                        target.data.copy_(value)
            del result, template, targets, values
            yield real
            del real  # released before the next parameter is loaded

    return write_hf_weights(staging, mappings, params, loaded(), out_dtype, max_shard_bytes, report)


# One lookup per directory: the located checkpoint and the LoRA base are each read again by
# the load (restore_checkpoint / load_peft_checkpoints).
@one_lookup_per_launch()
def export_hf_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    hf_dir: str | os.PathLike[str],
    *,
    hf_config_dir: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 1024**3,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write the model of a bridge-train checkpoint as a Hugging Face model directory.

    A LoRA run (``peft`` in its run config) is exported merged: base weights from its
    ``pretrained_checkpoint`` plus the adapters folded in.

    Args:
        ckpt_dir: A checkpoint directory (its newest checkpoint is exported) or one
            ``iter_*`` directory.
        hf_dir: New (or empty) output directory.
        hf_config_dir: Where ``config.json`` and tokenizer files come from (default: the
            ``hf/`` directory of an imported checkpoint or of the run's
            ``checkpoint.pretrained_checkpoint``).
        dtype: dtype of the written weights (default: the source's ``dtype`` in config.json).
        max_shard_bytes: Size of each safetensors shard.
        progress: Called with a short message per written tensor group.

    Returns:
        The output directory.

    A checkpoint with no Hugging Face config (a model trained from scratch) is written with
    the ``config.json`` of the first family whose preset reproduces its model section (the
    progress line says which), and the run's Hugging Face tokenizer when it has one.

    Raises:
        ConversionError: No checkpoint, no run config, a config of another architecture, a
            model no family matches (naming the fields), or an existing non-empty ``hf_dir``.
    """

    report = progress or (lambda message: None)
    try:
        root, iteration_dir = locate_checkpoint(Path(ckpt_dir))
    except CheckpointError as exc:
        raise ConversionError(str(exc)) from None
    try:
        run_config = saved_run_config(iteration_dir)
    except ConfigError as exc:
        raise ConversionError(f"{iteration_dir / RUN_CONFIG_FILENAME}: {exc}") from None
    if run_config is None:
        raise ConversionError(
            f"{iteration_dir} has no {RUN_CONFIG_FILENAME}; the model's shape cannot be known"
        )
    provider = run_config.model
    pretrained = run_config.checkpoint.pretrained_checkpoint if run_config.checkpoint else None
    family, config, prefix, written, files_dir = _hf_files(
        provider, run_config.tokenizer, root, pretrained, hf_config_dir, report
    )
    out_dtype = dtype or torch_dtype_of(written)

    out = Path(hf_dir).resolve()
    refuse_nonempty(out, "export into a new directory")
    single = single_rank_copy(provider)
    single.perform_initialization = False
    with staged(out, ".exporting") as staging:
        with single_process_megatron(single):
            mappings = family.param_mappings(config, single.padded_vocab_size, prefix)
            if run_config.peft is None:
                files, total = _stream_export(
                    iteration_dir, single, mappings, out_dtype, staging, max_shard_bytes, report
                )
            else:  # adapters are merged into the loaded base model
                report(f"loading {iteration_dir}")
                model = load_model_for_export(
                    iteration_dir, single, peft=run_config.peft, pretrained_checkpoint=pretrained
                )
                params = named_weights(model)
                wholes = (params[m.megatron].detach() for m in mappings)
                files, total = write_hf_weights(
                    staging, mappings, params, wholes, out_dtype, max_shard_bytes, report
                )
                del model, params
        report(f"wrote {len(files)} file(s), {total / 1e9:.3f} GB")
        write_side_files(staging, family, written, files_dir, out_dtype, copy_config=dtype is None)
    return out
