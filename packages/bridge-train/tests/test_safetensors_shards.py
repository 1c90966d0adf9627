"""The safetensors shards an export writes: readable by safetensors, with the usual file
mode; a damaged shard index is refused with one line naming it."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from bridge.train.convert import ConversionError
from bridge.train.convert.safetensors_io import (
    INDEX_FILENAME,
    SINGLE_FILENAME,
    SafetensorsReader,
    StreamingSafetensorsWriter,
)

safetensors = pytest.importorskip("safetensors")
pytest.importorskip("safetensors.torch")


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(6, 4, generator=generator),
        "model.norm.weight": torch.randn(4, generator=generator).to(torch.bfloat16),
        "lm_head.weight": torch.randn(6, 4, generator=generator).to(torch.float16),
    }


def _read(path: Path) -> dict[str, torch.Tensor]:
    with safetensors.safe_open(str(path), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118


def _plain_file_mode(directory: Path) -> int:
    probe = directory / "probe.txt"
    probe.write_text("x")
    return probe.stat().st_mode & 0o777


def _stream(directory: Path, tensors: dict[str, torch.Tensor], **kwargs: int) -> list[Path]:
    writer = StreamingSafetensorsWriter(
        directory, [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()], **kwargs
    )
    for name, tensor in tensors.items():
        writer.write(name, tensor)
    return writer.close()


@pytest.mark.parametrize("max_shard_bytes", [1 << 20, 64])
def test_shards_read_back_with_the_mode_of_other_files(
    tmp_path: Path, max_shard_bytes: int
) -> None:
    tensors = _tensors()
    files = _stream(tmp_path, tensors, max_shard_bytes=max_shard_bytes)
    shards = [f for f in files if f.name != INDEX_FILENAME]
    assert (len(shards) == 1) == (max_shard_bytes > 1000)
    if len(shards) == 1:
        assert shards[0].name == SINGLE_FILENAME
    read: dict[str, torch.Tensor] = {}
    for shard in shards:
        read.update(_read(shard))
    assert read.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert read[name].dtype == tensor.dtype and torch.equal(read[name], tensor)
    # safetensors' own save_file created 0600 files; an export's files are all alike.
    expected = _plain_file_mode(tmp_path)
    assert {f.stat().st_mode & 0o777 for f in files} == {expected}, [
        oct(f.stat().st_mode) for f in files
    ]


def test_a_streamed_file_is_the_bytes_safetensors_writes(tmp_path: Path) -> None:
    tensors = _tensors()
    expected = safetensors.torch.save(tensors, metadata={"format": "pt"})
    order = json.loads(expected[8 : 8 + struct.unpack("<Q", expected[:8])[0]])
    (written,) = _stream(tmp_path, {name: tensors[name] for name in order if name in tensors})
    assert written.read_bytes() == expected


@pytest.mark.parametrize(
    ("index", "needle"),
    [
        ("{not json", "is not a safetensors index: Expecting property name"),
        ('{"metadata": {}}', "is not a safetensors index: 'weight_map'"),
        ('["model-00001-of-00002.safetensors"]', "is not a safetensors index: "),
        ('{"weight_map": ["lm_head.weight"]}', "index: weight_map is list, not a mapping of"),
        ('{"weight_map": null}', "index: weight_map is NoneType, not a mapping of"),
        (
            '{"weight_map": {"lm_head.weight": "model-00009-of-00009.safetensors"}}',
            "model-00009-of-00009.safetensors is missing: model.safetensors.index.json lists "
            "it as a shard; download the complete checkpoint",
        ),
    ],
)
def test_a_damaged_shard_index_is_refused_naming_the_file(
    tmp_path: Path, index: str, needle: str
) -> None:
    """Bad JSON, no ``weight_map`` (or one that is no mapping), or a shard the index names
    that is not there: one line naming the file, before any tensor is read."""
    _stream(tmp_path, _tensors(), max_shard_bytes=64)  # a real sharded directory
    (tmp_path / INDEX_FILENAME).write_text(index)
    with pytest.raises(ConversionError) as caught:
        SafetensorsReader(tmp_path).names()
    message = str(caught.value)
    assert "\n" not in message and needle in message, message
    assert str(tmp_path) in message and INDEX_FILENAME in message, message
