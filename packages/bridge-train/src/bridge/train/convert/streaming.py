"""Save a model built on the meta device, producing each tensor only when it is written (internal).

megatron's ``torch_dist`` format is torch.distributed.checkpoint (DCP) underneath:
megatron translates its ``ShardedTensor``s into DCP tensors and DCP asks its save planner
for each write item's data (``SavePlanner.resolve_data``) while it writes. megatron's own
writer (``FileSystemWriterAsync``) resolves every item before writing any, which holds the
whole model at once; torch's ``FileSystemWriter`` resolves them one by one. So the import
builds the model on the meta device (shapes only, no memory), lets bridge-train's
``save_checkpoint`` build the sharded state dict, checks and commits as for any save, and
hands it this strategy: the same translation and planner as megatron's
``TorchDistSaveShardedStrategy``, with torch's serial writer and a planner that turns each
meta tensor into real data on demand (one parameter at a time, from a caller's function),
so the checkpoint that results is the same ``torch_dist`` checkpoint, written with about
one parameter resident.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)

from bridge.train.convert.model_weights import named_weights
from bridge.train.models.families import ConversionError

__all__ = ["StreamingSaveStrategy"]

# Where a meta tensor's data comes from: the parameter's name and the view into it.
_Source = tuple[str, torch.Size, tuple[int, ...], int]


class _StreamingPlanner(MCoreSavePlanner):
    """megatron's save planner, materialising meta tensors when DCP asks for them."""

    def __init__(
        self, sources: dict[tuple[str, tuple[int, ...]], _Source], produce: Callable[[str], Any]
    ) -> None:
        super().__init__(
            dedup_replicated_tensors=False, flatten_state_dict=False, flatten_sharded_tensors=False
        )
        self._sources = sources
        self._produce = produce
        # The last parameter produced: items of one parameter (the two halves of a gated
        # MLP's fc1) are usually written one after the other.
        self._cached: tuple[str, torch.Tensor] | None = None

    def resolve_data(self, write_item: Any) -> Any:
        data = super().resolve_data(write_item)
        if not isinstance(data, torch.Tensor) or not data.is_meta:
            return data
        key = (write_item.index.fqn, tuple(write_item.index.offset))
        if key not in self._sources:
            raise ConversionError(f"internal: no source for the meta tensor {key}")
        name, size, stride, offset = self._sources[key]
        if self._cached is None or self._cached[0] != name:
            self._cached = None  # released before the next parameter is produced
            self._cached = (name, self._produce(name))
        return self._cached[1].as_strided(size, stride, offset).reshape(data.shape)

    def release(self) -> None:
        """Drop the cached parameter."""
        self._cached = None


class StreamingSaveStrategy(TorchDistSaveShardedStrategy):
    """``torch_dist`` save of a meta-device model whose tensors are produced on demand.

    Args:
        model: The model chunk whose weights (parameters and persistent buffers) are on the
            meta device.
        produce: ``produce(name)`` returns the data of parameter ``name`` (any dtype; cast to
            the parameter's, checked for its shape). It is called when the parameter is
            written, and again if its pieces are not written one after the other.
    """

    def __init__(self, model: torch.nn.Module, produce: Callable[[str], torch.Tensor]) -> None:
        super().__init__("torch_dist", 1, thread_count=1)

        self._params = named_weights(model)
        self._name_of = {id(param): name for name, param in self._params.items()}
        self._produce = produce
        self.produced: set[str] = set()

    def _checked(self, name: str) -> torch.Tensor:
        meta = self._params[name]
        tensor = torch.as_tensor(self._produce(name))
        if tuple(tensor.shape) != tuple(meta.shape):
            raise ConversionError(
                f"internal: {name} was produced with shape {list(tensor.shape)}, the model's "
                f"is {list(meta.shape)}"
            )
        self.produced.add(name)
        tensor = tensor.to(dtype=meta.dtype).contiguous()
        if tensor.storage_offset() or tensor.untyped_storage().nbytes() != (
            tensor.numel() * tensor.element_size()
        ):
            # The planner addresses the parameter's storage (as_strided): a view into a
            # larger tensor must become a tensor of its own.
            tensor = tensor.clone()
        return tensor

    def _sources(self, sharded: dict[str, list[Any]]) -> dict[tuple[str, tuple[int, ...]], _Source]:
        sources: dict[tuple[str, tuple[int, ...]], _Source] = {}
        for key, items in sharded.items():
            for item in items:
                if not isinstance(item, ShardedTensor) or item.data is None:
                    continue
                data = item.data
                if not data.is_meta:
                    continue
                root = data._base if data._base is not None else data
                name = self._name_of.get(id(root))
                if name is None or not root.is_contiguous():
                    raise ConversionError(
                        f"internal: {key} is a meta tensor that is no view of a parameter"
                    )
                where = (key, tuple(int(x) for x in item.global_offset))
                if where in sources:
                    raise ConversionError(f"internal: {key} has two shards at {where[1]}")
                sources[where] = (name, data.shape, tuple(data.stride()), data.storage_offset())
        return sources

    def save(self, sharded_state_dict: dict[str, Any], checkpoint_dir: Path) -> None:
        """Write ``sharded_state_dict`` (translated as megatron does) one tensor at a time."""

        sharded, _, _ = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, self.keep_only_main_replica
        )
        # Recorded before the translation, which detaches (and may reshape) every tensor.
        sources = self._sources(sharded)
        pyt_state_dict = mcore_to_pyt_state_dict(sharded, False)
        planner = _StreamingPlanner(sources, self._checked)
        writer = dcp.FileSystemWriter(str(checkpoint_dir), thread_count=1, sync_files=True)
        try:
            dcp.save(pyt_state_dict, storage_writer=writer, planner=planner)
        finally:
            planner.release()
        left = sorted(set(self._params) - self.produced)
        if left:
            raise ConversionError(f"internal: {left[0]} was never written")
