"""Which rank sends which samples' embeddings to which rank: derived once from the layout.

Every data-parallel replica of a module owns a contiguous slice of each global micro-batch:
replica ``d`` of a module with data-parallel size ``D`` owns samples
``[d * M / D, (d + 1) * M / D)`` of a micro-batch of ``M`` samples. The embeddings of a
sample travel from the encoder replica that owns it to the language-model replica that owns
it, so one :class:`SampleTransfer` exists for every (encoder replica, language replica) pair
whose slices intersect. That covers fan-in (encoder DP > language DP), fan-out (encoder
DP < language DP), equal DP, and sizes that are not multiples of each other.

Forward: the encoder replica's leader (tensor-parallel rank 0) sends the rows of those
samples to every rank of the language replica (each tensor-parallel rank needs the full
embeddings). Backward: the language replica's leader sends the gradient of the same rows to
every rank of the encoder replica. Both sides read the same :class:`CrossModulePlan`, so a
send always has its matching receive (a mismatch would hang).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bridge.mimo.layout import MimoLayout

__all__ = ["CrossModulePlan", "SampleTransfer"]


@dataclass(frozen=True)
class SampleTransfer:
    """Samples ``[sample_start, sample_stop)`` of a micro-batch moving between replicas.

    Attributes:
        encoder: Name of the encoder module the embeddings come from.
        src_dp_rank: Data-parallel index of the encoder replica that owns the samples.
        dst_dp_rank: Data-parallel index of the language replica that consumes them.
        sample_start: First sample (index in the global micro-batch).
        sample_stop: One past the last sample.
        src_ranks: Global ranks of the encoder replica; ``src_ranks[0]`` is its leader.
        dst_ranks: Global ranks of the language replica; ``dst_ranks[0]`` is its leader.
    """

    encoder: str
    src_dp_rank: int
    dst_dp_rank: int
    sample_start: int
    sample_stop: int
    src_ranks: tuple[int, ...]
    dst_ranks: tuple[int, ...]

    @property
    def src_leader(self) -> int:
        """The encoder rank that sends the embeddings."""
        return self.src_ranks[0]

    @property
    def dst_leader(self) -> int:
        """The language-model rank that sends the gradients back."""
        return self.dst_ranks[0]

    @property
    def num_samples(self) -> int:
        """Number of samples moved."""
        return self.sample_stop - self.sample_start


def _slice(dp_rank: int, dp_size: int, micro_batch_size: int) -> tuple[int, int]:
    per_replica = micro_batch_size // dp_size
    return dp_rank * per_replica, (dp_rank + 1) * per_replica


class CrossModulePlan:
    """All encoder -> language-model transfers of one micro-batch, for a layout.

    Args:
        layout: The (non-colocated) layout.
        micro_batch_size: Samples per global micro-batch; divisible by every module's DP.

    Raises:
        ValueError: The layout is colocated (nothing to transfer) or the micro-batch size is
            not divisible by a module's data-parallel size.
    """

    def __init__(self, layout: MimoLayout, micro_batch_size: int) -> None:
        if layout.is_colocated:
            raise ValueError("a colocated layout has no cross-module transfers")
        for name, placement in layout.modules.items():
            if micro_batch_size < 1 or micro_batch_size % placement.dp_size:
                raise ValueError(
                    f"micro_batch_size={micro_batch_size} is not divisible by module {name!r}'s "
                    f"data-parallel size {placement.dp_size}"
                )
        self.layout = layout
        self.micro_batch_size = micro_batch_size
        language = layout.modules[layout.language_module]
        transfers: list[SampleTransfer] = []
        for encoder in layout.encoder_modules:
            placement = layout.modules[encoder]
            for dst in range(language.dp_size):
                dst_lo, dst_hi = _slice(dst, language.dp_size, micro_batch_size)
                for src in range(placement.dp_size):
                    src_lo, src_hi = _slice(src, placement.dp_size, micro_batch_size)
                    lo, hi = max(src_lo, dst_lo), min(src_hi, dst_hi)
                    if lo < hi:
                        transfers.append(
                            SampleTransfer(
                                encoder=encoder,
                                src_dp_rank=src,
                                dst_dp_rank=dst,
                                sample_start=lo,
                                sample_stop=hi,
                                src_ranks=placement.replica_ranks(src),
                                dst_ranks=language.replica_ranks(dst),
                            )
                        )
        self.transfers: tuple[SampleTransfer, ...] = tuple(transfers)

    def sample_slice(self, module: str, dp_rank: int) -> tuple[int, int]:
        """Samples ``[start, stop)`` of each micro-batch owned by replica ``dp_rank``."""
        placement = self.layout.modules[module]
        return _slice(dp_rank, placement.dp_size, self.micro_batch_size)

    def forward_sends(self, rank: int, encoder: str) -> list[tuple[SampleTransfer, int]]:
        """(transfer, destination rank) pairs ``rank`` sends embeddings for."""
        return [
            (t, dst)
            for t in self.transfers
            if t.encoder == encoder and t.src_leader == rank
            for dst in t.dst_ranks
        ]

    def forward_recvs(self, rank: int, encoder: str) -> list[SampleTransfer]:
        """Transfers whose embeddings ``rank`` receives (from each ``src_leader``), in order."""
        return [t for t in self.transfers if t.encoder == encoder and rank in t.dst_ranks]

    def backward_sends(self, rank: int, encoder: str) -> list[tuple[SampleTransfer, int]]:
        """(transfer, destination rank) pairs ``rank`` sends embedding gradients for."""
        return [
            (t, dst)
            for t in self.transfers
            if t.encoder == encoder and t.dst_leader == rank
            for dst in t.src_ranks
        ]

    def backward_recvs(self, rank: int, encoder: str) -> list[SampleTransfer]:
        """Transfers whose gradients ``rank`` receives (from each ``dst_leader``), in order."""
        return [t for t in self.transfers if t.encoder == encoder and rank in t.src_ranks]

    def peers(self, encoder: str, dp_rank: int, *, of_encoder: bool) -> list[SampleTransfer]:
        """Transfers touching one replica, ordered by sample.

        Args:
            encoder: The encoder module.
            dp_rank: Replica index, of the encoder when ``of_encoder`` else of the language
                model.
            of_encoder: Whether ``dp_rank`` indexes an encoder replica.
        """
        key = "src_dp_rank" if of_encoder else "dst_dp_rank"
        found = [t for t in self.transfers if t.encoder == encoder and getattr(t, key) == dp_rank]
        return sorted(found, key=lambda t: t.sample_start)


def row_ranges(
    transfers: list[SampleTransfer], local_start: int, tokens_per_sample: torch.Tensor
) -> list[tuple[int, int]]:
    """Rows of a flat ``[tokens, hidden]`` tensor that hold each transfer's samples.

    Args:
        transfers: Transfers within this rank's sample slice.
        local_start: First sample (micro-batch index) of this rank's slice.
        tokens_per_sample: Number of embedding rows of each local sample, in sample order.

    Returns:
        ``(row_start, row_stop)`` for each transfer.

    Raises:
        ValueError: A transfer falls outside the local samples.
    """
    counts = [int(c) for c in tokens_per_sample.tolist()]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    ranges = []
    for t in transfers:
        a, b = t.sample_start - local_start, t.sample_stop - local_start
        if a < 0 or b > len(counts):
            raise ValueError(
                f"transfer of samples [{t.sample_start}, {t.sample_stop}) is outside the local "
                f"samples [{local_start}, {local_start + len(counts)})"
            )
        ranges.append((offsets[a], offsets[b]))
    return ranges
