"""``AutoBridge``: Hugging Face models in and out, under the names Megatron-Bridge users know.

::

    from bridge.train.convert import AutoBridge

    bridge = AutoBridge.from_hf_pretrained("/models/Qwen3-30B-A3B")   # local directory
    provider = bridge.to_megatron_provider(tensor_model_parallel_size=2,
                                           expert_model_parallel_size=4)
    # ... initialise megatron's parallel state for that layout, then on every rank:
    model = provider.provide()
    bridge.load_hf_weights(model)                  # this rank's shards, from safetensors
    ...                                            # train
    bridge.save_hf_pretrained(model, "/out/qwen3-moe-tuned")   # streams out (rank 0 writes)

    AutoBridge.import_ckpt("/models/Qwen3-30B-A3B", "/ckpt/qwen3")     # bridge-convert import
    AutoBridge.export_ckpt("/ckpt/run", "/out/hf")                     # bridge-convert export

The family (one module per ``model_type`` in :mod:`bridge.train.models.families`) comes
from ``config.json``; nothing is downloaded. A model trained from scratch leaves through
:meth:`AutoBridge.from_provider` (the ``config.json`` is that of the first family whose
preset reproduces the provider) or ``export_ckpt``.

Differences from Megatron-Bridge: paths are local directories; ``to_megatron_provider``
never loads weights by itself (build the model, then :meth:`load_hf_weights`);
``import_ckpt`` / ``export_ckpt`` are :func:`~bridge.train.convert.import_hf_checkpoint` /
:func:`~bridge.train.convert.export_hf_checkpoint` and take their keyword arguments.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bridge.train.convert._runtime import refuse_nonempty, staged
from bridge.train.convert.exporter import export_hf_checkpoint, write_side_files
from bridge.train.convert.importer import import_hf_checkpoint
from bridge.train.convert.model_weights import (
    full_parameters,
    load_hf_weights,
    padded_vocab_of,
    write_hf_weights,
)
from bridge.train.convert.source import HFSource
from bridge.train.models.families import (
    ConversionError,
    HFFamily,
    match_family,
    provider_from_hf_config,
    supported_model_types,
    torch_dtype_of,
)
from core_utils.distributed import broadcast_from_rank0, global_rank, global_world_size
from core_utils.model_wrapping import ModelOrChunks

__all__ = ["AutoBridge"]


class AutoBridge:
    """A Hugging Face model (or a provider) and the family that maps it.

    Build it with :meth:`from_hf_pretrained` or :meth:`from_provider`.

    Attributes:
        family: The model's :class:`~bridge.train.models.families.HFFamily`.
        hf_config: The ``config.json`` (of the source, or written for the provider).
        hf_path: The source directory (``None`` for :meth:`from_provider`).
    """

    def __init__(
        self, family: HFFamily, hf_config: dict[str, Any], hf_path: Path | None = None
    ) -> None:
        self.family = family
        self.hf_config = hf_config
        self.hf_path = hf_path

    # ---- construction ----------------------------------------------------------------------

    @classmethod
    def from_hf_pretrained(cls, path: str | os.PathLike[str]) -> AutoBridge:
        """The bridge of a local Hugging Face model directory (``config.json`` + weights).

        Raises:
            ConversionError: Not a directory, no ``config.json``, or an unsupported
                ``model_type`` or setting (one line naming it).
        """

        source = HFSource(path)
        provider_from_hf_config(source.config)  # refuse what the family does not honour, now
        return cls(source.family, source.config, source.model_dir)

    @classmethod
    def from_provider(cls, provider: Any) -> AutoBridge:
        """The bridge of a model trained from scratch: the first family whose preset
        reproduces ``provider`` (its ``config.json`` is written on save).

        Raises:
            ConversionError: No family matches; the message names the provider fields.
        """
        return cls(*match_family(provider))

    @classmethod
    def can_handle(cls, path: str | os.PathLike[str]) -> bool:
        """Whether the directory's ``config.json`` names a supported ``model_type``."""
        try:
            cls.from_hf_pretrained(path)
        except ConversionError:
            return False
        return True

    @classmethod
    def list_supported_models(cls) -> list[str]:
        """The supported ``model_type`` values."""
        return list(supported_model_types())

    # ---- Hugging Face -> megatron ----------------------------------------------------------

    def to_megatron_provider(self, **kwargs: Any) -> Any:
        """The provider for this model; ``kwargs`` set the parallel layout
        (``tensor_model_parallel_size``, ``pipeline_model_parallel_size``,
        ``expert_model_parallel_size``), ``make_vocab_size_divisible_by``, ``seq_length`` and
        any other provider field (see :func:`~bridge.train.convert.provider_from_hf_config`).
        """
        return provider_from_hf_config(self.hf_config, **kwargs)

    def load_hf_weights(
        self, model: ModelOrChunks, hf_path: str | os.PathLike[str] | None = None
    ) -> None:
        """Load the Hugging Face weights into a built model (every rank its own shards).

        Args:
            model: The model chunk(s) of this rank, built from :meth:`to_megatron_provider`
                (any tensor, pipeline and expert parallel layout; wrapped or not).
            hf_path: Another directory with the same architecture (default: the source).

        Raises:
            ConversionError: Missing tensors or shapes that do not fit the model.
        """

        path = hf_path if hf_path is not None else self.hf_path
        if path is None:
            raise ConversionError(
                "this bridge has no Hugging Face weights (made from a provider); pass hf_path"
            )
        source = HFSource(path)
        try:
            load_hf_weights(model, source)
        finally:
            source.close()

    # ---- megatron -> Hugging Face -----------------------------------------------------------

    def _mappings(self, model: ModelOrChunks) -> list[Any]:

        text = self.family.text_config(self.hf_config)
        _, prefix = self.family.export_config(self.hf_config, None)
        return self.family.param_mappings(text, padded_vocab_of(model), prefix)

    def export_hf_weights(self, model: ModelOrChunks) -> Iterator[tuple[str, torch.Tensor | None]]:
        """The model's weights under their Hugging Face names, one at a time, on rank 0
        (``None`` on the other ranks, which must iterate too: they send their pieces)."""

        by_name = {mapping.megatron: mapping for mapping in self._mappings(model)}
        pieces: dict[str, list[torch.Tensor]] = {}  # of tensors stacking several parameters
        for name, full in full_parameters(model, list(by_name))[1]:
            mapping = by_name[name]
            whole = mapping.stack is None or mapping.stack[0] == mapping.stack[1] - 1
            if full is None:  # another rank: one None per Hugging Face tensor
                yield from ((hf_name, None) for hf_name in mapping.hf if whole)
                continue
            for hf_name, tensor in zip(mapping.hf, mapping.to_hf(full), strict=True):
                if mapping.stack is None:
                    yield hf_name, tensor
                    continue
                pieces.setdefault(hf_name, []).append(tensor)
                if whole:  # its last piece: the stacked tensor comes out whole
                    yield hf_name, torch.stack(pieces.pop(hf_name))

    def save_hf_weights(
        self,
        model: ModelOrChunks,
        path: str | os.PathLike[str],
        *,
        dtype: torch.dtype | None = None,
        max_shard_bytes: int = 5 * 1024**3,
        progress: Callable[[str], None] | None = None,
    ) -> list[Path]:
        """Write the weights (safetensors shards) into ``path``; call on every rank (rank 0
        writes). Returns the files written (on rank 0)."""

        mappings = self._mappings(model)
        metas, fulls = full_parameters(model, [mapping.megatron for mapping in mappings])
        files: list[Path] = []
        if global_rank() == 0:
            Path(path).mkdir(parents=True, exist_ok=True)
            wholes = (full for _, full in fulls if full is not None)
            report = progress or (lambda message: None)
            files, _ = write_hf_weights(
                Path(path), mappings, metas, wholes, dtype or self.dtype, max_shard_bytes, report
            )
        else:
            for _ in fulls:  # this rank's pieces are sent to rank 0
                pass
        if global_world_size() > 1:
            dist.barrier()
        return files

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the Hugging Face weights are stored in."""
        return torch_dtype_of(self.hf_config)

    def save_hf_pretrained(
        self,
        model: ModelOrChunks,
        path: str | os.PathLike[str],
        *,
        dtype: torch.dtype | None = None,
        max_shard_bytes: int = 5 * 1024**3,
        progress: Callable[[str], None] | None = None,
    ) -> Path:
        """Write a Hugging Face model directory that ``transformers`` loads: the weights
        (streamed, LoRA adapters folded in), ``config.json``, ``generation_config.json`` and
        the source's tokenizer and other side files. Call on every rank; rank 0 writes.

        Args:
            model: This rank's model chunk(s).
            path: A new (or empty) directory; it appears only complete.
            dtype: dtype of the written weights (default: the source's).
            max_shard_bytes: Bytes per safetensors shard.
            progress: Called with a short message per written tensor group (rank 0).

        Raises:
            ConversionError: ``path`` exists and is not empty.
        """

        out = Path(path).resolve()
        problem = ""
        if global_rank() == 0:
            try:
                refuse_nonempty(out, "save into a new directory")
            except ConversionError as exc:
                problem = str(exc)
        problem = broadcast_from_rank0(problem)
        if problem:
            raise ConversionError(problem)
        staging = out.with_name(out.name + ".exporting")  # rank 0 makes it, and renames it
        with staged(out, ".exporting") if global_rank() == 0 else contextlib.nullcontext(staging):
            self.save_hf_weights(
                model, staging, dtype=dtype, max_shard_bytes=max_shard_bytes, progress=progress
            )
            if global_rank() == 0:
                written, _ = self.family.export_config(self.hf_config, None)
                write_side_files(
                    staging,
                    self.family,
                    written,
                    self.hf_path,
                    dtype or self.dtype,
                    copy_config=dtype is None,
                )
        if global_world_size() > 1:
            dist.barrier()
        return out

    # ---- checkpoint conversions (bridge-convert) ---------------------------------------------

    @classmethod
    def import_ckpt(
        cls, hf_path: str | os.PathLike[str], megatron_path: str | os.PathLike[str], **kwargs: Any
    ) -> Path:
        """A Hugging Face directory -> a bridge-train checkpoint
        (:func:`~bridge.train.convert.import_hf_checkpoint`; one process)."""

        return import_hf_checkpoint(hf_path, megatron_path, **kwargs)

    @classmethod
    def export_ckpt(
        cls, megatron_path: str | os.PathLike[str], hf_path: str | os.PathLike[str], **kwargs: Any
    ) -> Path:
        """A bridge-train checkpoint -> a Hugging Face directory
        (:func:`~bridge.train.convert.export_hf_checkpoint`; one process)."""

        return export_hf_checkpoint(megatron_path, hf_path, **kwargs)
