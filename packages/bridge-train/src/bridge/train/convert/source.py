"""A local Hugging Face model directory read through its family (the importer's and
:class:`~bridge.train.convert.AutoBridge`'s one way in)."""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path
from typing import Any

import torch

from bridge.train.convert.safetensors_io import SafetensorsReader
from bridge.train.models.families import (
    ConversionError,
    ParamMapping,
    family_for,
    read_hf_config,
    torch_dtype_of,
)

__all__ = ["HFSource", "side_files"]

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt")


def side_files(directory: Path) -> list[Path]:
    """Every file of a model directory that is not weights or a weight index: config,
    tokenizer, chat template, generation config, ..."""
    return [
        item
        for item in sorted(directory.iterdir())
        if item.is_file()
        and not item.name.endswith(_WEIGHT_SUFFIXES)
        and not item.name.endswith(".index.json")
    ]


class HFSource(SafetensorsReader):
    """``config.json``, the family that reads it, and the safetensors weights of a directory
    (read on first use).

    Args:
        hf_dir: Directory with ``config.json`` and safetensors weights (one file, or shards
            with ``model.safetensors.index.json``).

    Attributes:
        config: ``config.json`` as a dict.
        family: Its :class:`~bridge.train.models.families.HFFamily`.
        text_config: The part of ``config`` the family imports (the language model).
        dtype: The dtype the weights are stored in.

    Raises:
        ConversionError: No ``config.json``, or an unknown ``model_type``.
    """

    def __init__(self, hf_dir: str | os.PathLike[str]) -> None:
        super().__init__(hf_dir)
        self.config: dict[str, Any] = read_hf_config(self.model_dir)
        self.family = family_for(self.config)
        self.text_config: dict[str, Any] = self.family.text_config(self.config)
        self.dtype: torch.dtype = torch_dtype_of(self.config)

    @functools.cached_property
    def prefix(self) -> str:
        """The prefix of the checkpoint's tensor names."""
        return self.family.detect_prefix(set(self.names()))

    def mappings(self, padded_vocab: int) -> list[ParamMapping]:
        """The family's mappings for this checkpoint, checked against its tensors.

        Args:
            padded_vocab: Rows of the megatron embedding and output layer.

        Raises:
            ConversionError: A tensor the config needs is missing, or the checkpoint has
                one the family does not map (and does not ignore).
        """
        names = set(self.names())
        mappings = self.family.param_mappings(self.text_config, padded_vocab, self.prefix)
        wanted = {name for mapping in mappings for name in mapping.hf}
        missing = sorted(wanted - names)
        if missing:
            raise ConversionError(
                f"{self.model_dir}: the checkpoint lacks {len(missing)} tensor(s) this "
                f"config.json needs, first {missing[0]!r}; the weights do not belong to this "
                "config"
            )
        unexpected = sorted(
            n
            for n in names - wanted
            if not (self.family.ignores(n) or self.family.skips(n, self.text_config))
        )
        if unexpected:
            raise ConversionError(
                f"{self.model_dir}: {len(unexpected)} tensor(s) this converter does not map, "
                f"first {unexpected[0]!r} (in {self._file_of[unexpected[0]]}); the "
                f"architecture differs from model_type={self.config.get('model_type')!r}"
            )
        return mappings

    def skipped(self) -> list[str]:
        """Checkpoint tensors outside the imported model (a multimodal model's vision tower),
        to report."""
        return sorted(n for n in self.names() if self.family.skips(n, self.text_config))

    def megatron_tensor(self, mapping: ParamMapping) -> torch.Tensor:
        """The megatron parameter ``mapping`` makes, assembled from the checkpoint (a stacked
        mapping reads only its slice of each tensor)."""
        index = None if mapping.stack is None else mapping.stack[0]
        with torch.no_grad():
            return mapping.to_megatron(*(self.get(name, index) for name in mapping.hf))

    def check_shapes(self, mappings: list[ParamMapping], params: dict[str, torch.Tensor]) -> None:
        """Every mapping produces its parameter's shape (on meta tensors: no data is read).

        Raises:
            ConversionError: A mismatch, naming the tensors, their files and both shapes.
        """
        for mapping in mappings:
            if mapping.megatron not in params:
                raise ConversionError(
                    f"internal: the megatron model has no parameter {mapping.megatron!r}"
                )
            expected = tuple(params[mapping.megatron].shape)
            shapes = [self.shape(n) for n in mapping.hf]
            # A stacked mapping reads one of the `count` pieces each tensor stacks.
            fits = mapping.stack is None or all(s and s[0] == mapping.stack[1] for s in shapes)
            shapes = shapes if mapping.stack is None else [s[1:] for s in shapes]
            produced: tuple[int, ...] | None = None
            with contextlib.suppress(RuntimeError):
                metas = (torch.empty(shape, device="meta") for shape in shapes)
                produced = tuple(mapping.to_megatron(*metas).shape) if fits else None
            if produced != expected:
                listed = ", ".join(
                    f"{n} {list(self.shape(n))} in {self._file_of[n]}" for n in mapping.hf
                )
                raise ConversionError(
                    f"shape mismatch: {listed} do not make {mapping.megatron} of shape "
                    f"{list(expected)} for this config.json"
                )
