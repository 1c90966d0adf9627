"""Hugging Face weights into and out of a built, parallel megatron model (in memory).

A family's mappings name the parameters of the one-process model; a rank of a parallel
model holds pieces of them. :func:`local_parameters` names each local parameter the way the
one-process model does (global layer number for pipeline stages, global expert number for
expert parallelism) and records how it is split: along ``partition_dim`` over its
tensor-parallel group (the expert tensor-parallel group for experts), or, for the first
layer of a gated MLP, as ``[gate piece; up piece]`` (megatron splits the gate and the up
projection separately, so the local rows are not one contiguous slice of ``[gate; up]``).

* :func:`load_hf_weights`: every rank reads the Hugging Face tensors of its own parameters
  (through the family's mapping) and copies its slice in.
* :func:`full_parameters`: parameter by parameter in Hugging Face order, the holders gather
  the full tensor over their tensor-parallel group (LoRA adapters folded in), the lowest
  holding rank sends it to rank 0, and rank 0 writes it (:func:`write_hf_weights`) into
  safetensors shards whose headers were computed first: one parameter is resident at a time.

"Parameters" here are a model's *weights* (:func:`named_weights`): its parameters and its
persistent buffers, which a checkpoint holds too (megatron's router keeps DeepSeek-V3's
expert-bias correction, ``expert_bias``, as a buffer).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from bridge.train.convert.safetensors_io import StreamingSafetensorsWriter
from bridge.train.models.families import ConversionError, ParamMapping
from bridge.train.peft.base import global_module_paths
from core_utils.distributed import gather_from_every_rank, global_rank
from core_utils.model_wrapping import ModelOrChunks

__all__ = [
    "LocalParameter",
    "build_on_meta",
    "full_parameters",
    "load_hf_weights",
    "local_parameters",
    "named_weights",
    "padded_vocab_of",
    "write_hf_weights",
]


@dataclass
class LocalParameter:
    """One parameter of this rank and where it sits in the one-process model.

    Attributes:
        name: The parameter's name in the one-process model.
        param: The local parameter.
        module: The module that owns it (a LoRA adapter, if any, hangs off it).
        group: The process group it is split over, or ``None`` when this rank holds it whole.
        dim: The split dimension.
        gated: A gated MLP's ``linear_fc1`` (split as ``[gate piece; up piece]``).
    """

    name: str
    param: torch.Tensor
    module: torch.nn.Module
    group: Any
    dim: int
    gated: bool

    @property
    def parts(self) -> int:
        """How many ranks the parameter is split over."""
        return 1 if self.group is None else dist.get_world_size(self.group)

    @property
    def part(self) -> int:
        """This rank's piece."""
        return 0 if self.group is None else dist.get_rank(self.group)


def _own_weights(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A module's own parameters, then its own persistent buffers."""
    yield from module.named_parameters(recurse=False)
    for name, buffer in module.named_buffers(recurse=False):
        if name not in module._non_persistent_buffers_set:
            yield name, buffer


def named_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight of ``model`` by name: its parameters and its persistent buffers (what a
    checkpoint stores)."""
    return {
        f"{module_name}.{name}" if module_name else name: tensor
        for module_name, module in model.named_modules()
        for name, tensor in _own_weights(module)
    }


def build_on_meta(provider: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """The one-process model of ``provider`` on the meta device (shapes and sharding, no
    memory; not initialised) and its weights by name (:func:`named_weights`).

    megatron places weights on the GPU explicitly unless they are initialised on the CPU;
    with CPU initialisation it leaves the device to the meta-device context. Modules that
    place a buffer on an explicit device (megatron's router puts ``expert_bias`` on
    ``torch.cuda.current_device()``) escape that context: such persistent buffers are moved
    to the meta device too, so a conversion streaming tensors in or out never writes their
    real zeros for the checkpoint's values.
    """
    provider.perform_initialization = False
    provider.use_cpu_initialization = True
    with torch.device("meta"):
        model = provider.provide(pre_process=True, post_process=True)
    for module in model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            if name not in module._non_persistent_buffers_set and not buffer.is_meta:
                module._buffers[name] = torch.empty_like(buffer, device="meta")
    params = named_weights(model)
    real = [name for name, param in params.items() if not param.is_meta]
    if real:  # its data would be written instead of the source's
        raise ConversionError(f"internal: {real[0]} was not built on the meta device")
    return model, params


def _unwrap(chunk: Any) -> Any:
    while not hasattr(chunk, "decoder") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def local_parameters(model: ModelOrChunks) -> list[LocalParameter]:
    """This rank's parameters (adapters excluded), named as in the one-process model.

    Args:
        model: A model chunk or a list of chunks (wrapped for data parallelism or not).
    """
    chunks = model if isinstance(model, (list, tuple)) else [model]
    found: list[LocalParameter] = []
    for chunk in chunks:
        inner = _unwrap(chunk)
        gated = bool(getattr(inner.config, "gated_linear_unit", False))
        paths = global_module_paths(inner)
        for module_name, module in inner.named_modules():
            for param_name, param in _own_weights(module):
                full = f"{paths[module_name]}.{param_name}" if module_name else param_name
                if ".adapter." in f".{full}":  # a LoRA adapter's own weights
                    continue
                split = bool(getattr(param, "tensor_model_parallel", False))
                group = getattr(module, "tp_group", None) if split else None
                if split and group is None:
                    group = (
                        parallel_state.get_expert_tensor_parallel_group()
                        if ".mlp.experts." in full
                        else parallel_state.get_tensor_model_parallel_group()
                    )
                if group is not None and dist.get_world_size(group) == 1:
                    group = None
                found.append(
                    LocalParameter(
                        name=full,
                        param=param,
                        module=module,
                        group=group,
                        dim=int(getattr(param, "partition_dim", 0)),
                        gated=gated and full.rsplit(".", 2)[-2] == "linear_fc1",
                    )
                )
    return found


def padded_vocab_of(model: ModelOrChunks) -> int:
    """Rows of the whole (unsplit) embedding / output layer of ``model``."""
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    padded = getattr(_unwrap(chunks[0]).config, "padded_vocab_size", None)
    if isinstance(padded, int):
        return padded
    for entry in local_parameters(chunks):
        if entry.name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            return int(entry.param.shape[0]) * entry.parts
    raise ConversionError("the model has no embedding or output layer on this rank")


def _slice(full: torch.Tensor, entry: LocalParameter) -> torch.Tensor:
    if entry.group is None:
        return full
    if entry.gated:
        halves = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(h, entry.parts, dim=0)[entry.part] for h in halves])
    return torch.chunk(full, entry.parts, dim=entry.dim)[entry.part]


def load_hf_weights(model: ModelOrChunks, source: Any) -> None:
    """Copy the weights of ``source`` (a :class:`~bridge.train.convert.source.HFSource`)
    into every parameter of this rank's chunks.

    Call on every rank; it ends with a check (an all-gather) that every parameter of the
    family's mapping was loaded by some rank.

    Raises:
        ConversionError: A parameter without a Hugging Face source, a shape mismatch, or a
            mapping no rank had a parameter for.
    """
    entries = local_parameters(model)
    by_name = {mapping.megatron: mapping for mapping in source.mappings(padded_vocab_of(model))}
    config = _unwrap(model[0] if isinstance(model, (list, tuple)) else model).config
    tied = bool(getattr(config, "share_embeddings_and_output_weights", False))
    loaded: set[str] = set()
    for entry in entries:
        mapping = by_name.get(entry.name)
        if mapping is None and tied and entry.name == "output_layer.weight":
            # A tied output layer on the last pipeline stage is a copy of the embedding.
            mapping = by_name.get("embedding.word_embeddings.weight")
        if mapping is None:
            raise ConversionError(f"internal: no Hugging Face source for {entry.name!r}")
        piece = _slice(source.megatron_tensor(mapping), entry)
        if tuple(piece.shape) != tuple(entry.param.shape):
            raise ConversionError(
                f"shape mismatch: {', '.join(mapping.hf)} make {entry.name} of shape "
                f"{list(piece.shape)} on this rank; the model's is {list(entry.param.shape)}"
            )
        with torch.no_grad():
            entry.param.copy_(piece)
        loaded.add(mapping.megatron)
    loaded = {name for names in gather_from_every_rank(sorted(loaded)) for name in names}
    left = sorted(set(by_name) - loaded)
    if left:
        raise ConversionError(
            f"{len(left)} Hugging Face weight(s) found no parameter in the model, first "
            f"{left[0]!r}: the model was built from another config"
        )


def _gathered(entry: LocalParameter) -> torch.Tensor:
    """The whole parameter, gathered over its group (collective over the group), with a
    LoRA adapter of its layer folded in (weights only)."""
    local = entry.param.detach()
    adapter = getattr(entry.module, "adapter", None)
    if adapter is not None and entry.param is getattr(entry.module, "weight", None):
        local = local + adapter.delta_weight().to(local.dtype)
    local = local.contiguous()
    if entry.group is None:
        return local
    # A gated fc1 is split as [gate piece; up piece]: gather each half on its own.
    halves = torch.chunk(local, 2, dim=0) if entry.gated else (local,)
    gathered = []
    for half in halves:
        parts = [torch.empty_like(half) for _ in range(entry.parts)]
        dist.all_gather(parts, half.contiguous(), group=entry.group)
        gathered.append(torch.cat(parts, dim=entry.dim))
    return torch.cat(gathered, dim=0)


def full_parameters(
    model: ModelOrChunks, names: list[str]
) -> tuple[dict[str, torch.Tensor], Iterator[tuple[str, torch.Tensor | None]]]:
    """Every rank's parameters, whole, on rank 0: ``(meta tensor of every parameter some rank
    holds, by name; iterator of the whole parameters ``names``, in order, on rank 0, ``None``
    elsewhere)``.

    Collective: the census of every rank's names and whole shapes happens at once, and every
    rank must iterate to the end (it takes part in gathers and sends). A name no rank holds
    raises :class:`ConversionError` on every rank.
    """
    entries = {entry.name: entry for entry in local_parameters(model)}
    local: dict[str, tuple[list[int], str]] = {}
    for name, entry in entries.items():
        shape = list(entry.param.shape)
        shape[entry.dim] *= entry.parts
        local[name] = (shape, str(entry.param.dtype).removeprefix("torch."))
    owner: dict[str, int] = {}
    metas: dict[str, torch.Tensor] = {}
    for holder, held in enumerate(gather_from_every_rank(local)):
        for name, (shape, dtype) in held.items():
            owner.setdefault(name, holder)  # the lowest rank holding it sends it
            metas.setdefault(name, torch.empty(shape, dtype=getattr(torch, dtype), device="meta"))
    missing = [name for name in names if name not in owner]
    if missing:
        raise ConversionError(
            f"no rank holds {missing[0]!r}: the model was built from another config"
        )
    rank = global_rank()

    def fulls() -> Iterator[tuple[str, torch.Tensor | None]]:
        for name in names:
            full: torch.Tensor | None = None
            if name in entries:
                with torch.no_grad():
                    full = _gathered(entries[name])
            source = owner[name]
            if source != 0:
                if rank == source:
                    assert full is not None
                    dist.send(full.contiguous(), dst=0)
                elif rank == 0:
                    full = torch.empty_like(metas[name], device="cpu")
                    dist.recv(full, src=source)
            yield name, (full if rank == 0 else None)

    return metas, fulls()


def write_hf_weights(
    out: Path,
    mappings: list[ParamMapping],
    params: dict[str, torch.Tensor],
    tensors: Iterable[torch.Tensor],
    dtype: torch.dtype | None,
    max_shard_bytes: int,
    report: Callable[[str], None],
) -> tuple[list[Path], int]:
    """Stream each mapping's Hugging Face tensors into safetensors shards in ``out``.

    ``params`` gives each megatron parameter's shape and dtype (any device: the shard headers
    are computed from them first, on the meta device); ``tensors`` yields each mapping's
    whole parameter in order, produced one at a time. Returns ``(files written, bytes of
    tensor data)``.
    """
    declared: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    for mapping in mappings:
        if mapping.stack is not None and mapping.stack[0] != 0:
            continue  # a stacked tensor is declared whole, with its first piece
        stacked = () if mapping.stack is None else (mapping.stack[1],)
        meta = params[mapping.megatron].to("meta")
        for name, piece in zip(mapping.hf, mapping.to_hf(meta), strict=True):
            declared.append((name, (*stacked, *piece.shape), dtype or piece.dtype))
    writer = StreamingSafetensorsWriter(out, declared, max_shard_bytes)
    with torch.no_grad():
        for count, (mapping, full) in enumerate(zip(mappings, tensors, strict=True), start=1):
            pieces = mapping.to_hf(full)
            del full  # released before the next parameter is produced
            for name, piece in zip(mapping.hf, pieces, strict=True):
                writer.write(name, piece.to(dtype or piece.dtype).contiguous(), mapping.stack)
            del pieces, piece
            report(f"[{count}/{len(mappings)}] {mapping.megatron}")
    return writer.close(), writer.total_bytes
