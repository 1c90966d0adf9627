"""Read a Hugging Face safetensors checkpoint one tensor at a time, and write one in shards."""

from __future__ import annotations

import functools
import json
import os
import struct
from pathlib import Path
from typing import Any

import torch

from bridge.train.models.families import ConversionError

__all__ = [
    "INDEX_FILENAME",
    "SINGLE_FILENAME",
    "SafetensorsReader",
    "StreamingSafetensorsWriter",
]

INDEX_FILENAME = "model.safetensors.index.json"
SINGLE_FILENAME = "model.safetensors"


class SafetensorsReader:
    """The tensors of a model directory, sharded (``model.safetensors.index.json``) or not.

    Files are memory-mapped by ``safetensors``; :meth:`get` copies one tensor out, so only
    the tensors a caller holds are resident. The weights are found on first use.

    Args:
        model_dir: A Hugging Face model directory.

    Raises:
        ConversionError: (On first use) no safetensors weights, an unreadable index, or a
            shard the index names that is missing.
    """

    def __init__(self, model_dir: str | os.PathLike[str]) -> None:
        self.model_dir = Path(model_dir)
        self._handles: dict[str, Any] = {}

    @functools.cached_property
    def _file_of(self) -> dict[str, str]:
        """Which file holds each tensor (read on first use: a directory's config alone
        needs no weights)."""
        try:
            from safetensors import safe_open
        except ImportError:
            raise ConversionError(
                "Hugging Face conversion needs the 'safetensors' package: "
                "pip install bridge-train[hf]"
            ) from None
        index = self.model_dir / INDEX_FILENAME
        single = self.model_dir / SINGLE_FILENAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError(
                        f"weight_map is {type(weight_map).__name__}, not a mapping of tensor "
                        "names to shard files"
                    )
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ConversionError(f"{index} is not a safetensors index: {exc}") from None
            file_of = {str(k): str(v) for k, v in weight_map.items()}
        elif single.is_file():
            with safe_open(str(single), framework="pt") as handle:
                file_of = {name: SINGLE_FILENAME for name in handle.keys()}  # noqa: SIM118
        else:
            raise ConversionError(
                f"{self.model_dir} has neither {SINGLE_FILENAME} nor {INDEX_FILENAME}; only "
                "safetensors checkpoints are supported (save with safe_serialization=True)"
            )
        for file in sorted(set(file_of.values())):
            if not (self.model_dir / file).is_file():
                raise ConversionError(
                    f"{self.model_dir / file} is missing: {INDEX_FILENAME} lists it as a shard; "
                    "download the complete checkpoint"
                )
        return file_of

    def names(self) -> list[str]:
        """Every tensor name, in the order of the index."""
        return list(self._file_of)

    def _handle(self, name: str) -> Any:
        if name not in self._file_of:
            raise ConversionError(
                f"{self.model_dir}: the checkpoint has no tensor {name!r}, which the config "
                "requires; the weights do not belong to this config.json"
            )
        file = self._file_of[name]
        if file not in self._handles:
            from safetensors import safe_open

            self._handles[file] = safe_open(str(self.model_dir / file), framework="pt")
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of ``name`` without reading its data."""
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get(self, name: str, index: int | None = None) -> torch.Tensor:
        """A copy of the tensor ``name`` (with ``index``: of its ``index``-th slice along
        the first dimension only, read without the rest)."""
        try:
            if index is not None:
                # The slice is a view into the (memory-mapped) whole tensor: own just it.
                return self._handle(name).get_slice(name)[index].clone()
            return self._handle(name).get_tensor(name)
        except Exception as exc:  # safetensors raises its own error types
            if isinstance(exc, ConversionError):
                raise
            raise ConversionError(
                f"{self.model_dir / self._file_of[name]}: cannot read {name!r}: {exc}"
            ) from None

    def close(self) -> None:
        """Release the memory maps."""
        self._handles.clear()


# safetensors' names of the dtypes a converted model is written in.
_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
}


def _header(entries: list[tuple[str, tuple[int, ...], torch.dtype, int]]) -> bytes:
    """The safetensors header of ``(name, shape, dtype, bytes)`` entries stored in order.

    What ``safetensors.torch.save_file`` writes: an 8-byte length, then the JSON (names,
    dtypes, shapes, offsets, ``{"format": "pt"}`` metadata) padded to 8 bytes.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype, size in entries:  # dtypes checked by the writer
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


class StreamingSafetensorsWriter:
    """Write tensors into safetensors shards one at a time, each written as it arrives.

    The safetensors header (names, dtypes, shapes, offsets) comes first in a file, so the
    tensors are declared up front (``entries``, in the order :meth:`write` will get them)
    and split into shards of at most ``max_shard_bytes`` in that order; each tensor's bytes
    go to disk when it is written, so only the tensor in hand is resident. The files are
    what ``safetensors.torch.save_file`` writes (header padded to 8 bytes, data in header
    order, ``{"format": "pt"}`` metadata), but with the mode of every other file of the
    export (``save_file`` creates them 0600); ``safetensors`` and ``transformers`` read
    them.

    Args:
        out_dir: Directory to write into.
        entries: ``(name, shape, dtype)`` of every tensor, in writing order.
        max_shard_bytes: Bytes per shard (a larger tensor gets a shard of its own).
    """

    def __init__(
        self,
        out_dir: str | Path,
        entries: list[tuple[str, tuple[int, ...], torch.dtype]],
        max_shard_bytes: int = 5 * 1024**3,
    ) -> None:
        self.out_dir = Path(out_dir)
        self._shards: list[list[tuple[str, tuple[int, ...], torch.dtype, int]]] = []
        filled = 0
        for name, shape, dtype in entries:
            if dtype not in _SAFETENSORS_DTYPES:
                raise ConversionError(f"{name}: dtype {dtype} cannot be written to safetensors")
            size = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            if not self._shards or (filled and filled + size > max_shard_bytes):
                self._shards.append([])
                filled = 0
            self._shards[-1].append((name, tuple(shape), dtype, size))
            filled += size
        self.total_bytes = sum(e[3] for shard in self._shards for e in shard)
        self._order = [(i, e) for i, shard in enumerate(self._shards) for e in shard]
        self._next = 0
        self._pieces_written = 0  # of the current (stacked) tensor
        self._file: Any = None
        self._temps: list[Path] = []

    def _open(self, index: int) -> None:
        if self._file is not None:
            self._finish_file()
        temp = self.out_dir / f"shard-{index:05d}.tmp"
        self._temps.append(temp)
        self._file = open(temp, "wb")  # noqa: SIM115 (closed in _finish_file)
        self._file.write(_header(self._shards[index]))

    def _finish_file(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None

    def write(self, name: str, tensor: torch.Tensor, stack: tuple[int, int] | None = None) -> None:
        """Write the next declared tensor (same name, shape and dtype as declared), or, with
        ``stack=(index, count)``, its ``index``-th slice along the first dimension (the
        slices in order, one after the other: each goes to disk as it arrives)."""
        if self._next >= len(self._order):
            raise ConversionError(f"internal: {name} was not declared to the writer")
        index, (expected, shape, dtype, _) = self._order[self._next]
        piece, count = stack if stack is not None else (0, None)
        wanted = shape if count is None else (count, *tuple(tensor.shape))
        if (
            name != expected
            or wanted != shape
            or tensor.dtype != dtype
            or piece != self._pieces_written
        ):
            raise ConversionError(
                f"internal: writer expected {expected} {list(shape)} {dtype} (piece "
                f"{self._pieces_written}), got {name} {list(tensor.shape)} {tensor.dtype} "
                f"(piece {piece} of {count})"
            )
        if self._file is None or index != len(self._temps) - 1:
            self._open(index)
        # The raw little-endian bytes (row-major), as safetensors stores them.
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        self._file.write(memoryview(data.numpy()))
        if count is not None and piece + 1 < count:
            self._pieces_written += 1
            return
        self._pieces_written = 0
        self._next += 1

    def close(self) -> list[Path]:
        """Finish the last shard, give the shards their names and write the index."""
        if self._next != len(self._order):
            raise ConversionError(
                f"internal: {self._order[self._next][1][0]} was declared but never written"
            )
        if self._file is not None:
            self._finish_file()
        count = len(self._shards)
        names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        final = [self.out_dir / name for name in (names if count > 1 else [SINGLE_FILENAME])]
        for temp, path in zip(self._temps, final, strict=True):
            os.replace(temp, path)
        if len(final) > 1:
            weight_map = {
                e[0]: final[i].name for i, shard in enumerate(self._shards) for e in shard
            }
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.out_dir / INDEX_FILENAME).write_text(json.dumps(index, indent=2) + "\n")
            final.append(self.out_dir / INDEX_FILENAME)
        return final
