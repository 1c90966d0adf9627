"""The cross-module data path: encoder embeddings forward, their gradients back.

Two implementations of one small interface (:class:`ModuleCommunicator`):

* :class:`P2PModuleCommunicator` (default, CPU and GPU): ``torch.distributed`` isend/irecv
  following a :class:`~bridge.mimo.comm_plan.CrossModulePlan`. Sends are non-blocking, so an
  encoder can compute the next micro-batch while the language model works on the previous.
* :class:`MegatronBridgeModuleCommunicator` (GPU): megatron-core's ``BridgeCommunicator``
  per encoder. It creates ``nccl`` groups, so it needs CUDA; on a CPU-only machine it runs
  only when explicitly asked to through ``core_utils.cuda_compat`` (used by the tests to
  check it against the P2P path).

Embeddings are flat ``[tokens, hidden]`` tensors whose rows are grouped by sample in sample
order (megatron's MIMO encoder output). The number of rows of each sample comes from the
micro-batch itself (the count of the encoder's special token in each sample's input ids),
which both sides know, so no shapes travel over the wire.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

from bridge.mimo.comm_plan import CrossModulePlan, SampleTransfer, row_ranges
from bridge.mimo.infra import MegatronMIMOInfra

__all__ = [
    "MegatronBridgeModuleCommunicator",
    "ModuleCommunicator",
    "P2PModuleCommunicator",
    "PendingSends",
]


class PendingSends:
    """Sends in flight; keeps their buffers alive until :meth:`wait` returns."""

    def __init__(self) -> None:
        self._works: list[Any] = []
        self._buffers: list[torch.Tensor] = []

    def add(self, work: Any) -> None:
        """Track a send's work handle (``None``, from a completed send, is ignored)."""
        if work is not None:
            self._works.append(work)

    def keep(self, buffer: torch.Tensor) -> None:
        """Keep a send buffer alive until :meth:`wait`."""
        self._buffers.append(buffer)

    def wait(self) -> None:
        """Block until every send has completed."""
        for work in self._works:
            work.wait()
        self._works.clear()
        self._buffers.clear()


class ModuleCommunicator(Protocol):
    """Moves embeddings from encoder ranks to language-model ranks and gradients back.

    ``tokens_per_sample`` is always the number of embedding rows of each sample of *this
    rank's* slice of the micro-batch, in sample order. ``microbatch`` is the index of the
    micro-batch within the step (every rank processes micro-batches in the same order).
    """

    #: How many forward sends an encoder may have outstanding before it must receive the
    #: gradient of the oldest (0: strictly one micro-batch at a time).
    max_outstanding_forwards: int

    def send_forward(
        self, encoder: str, output: torch.Tensor, tokens_per_sample: torch.Tensor, microbatch: int
    ) -> PendingSends:
        """Send this encoder rank's embeddings to the language-model ranks."""
        ...

    def recv_forward(
        self, encoder: str, tokens_per_sample: torch.Tensor, microbatch: int
    ) -> torch.Tensor:
        """Receive this language rank's embeddings of ``encoder``; a leaf requiring grad."""
        ...

    def send_backward(
        self, encoder: str, grad: torch.Tensor, tokens_per_sample: torch.Tensor, microbatch: int
    ) -> PendingSends:
        """Send the gradient of the received embeddings back to the encoder ranks."""
        ...

    def recv_backward(
        self, encoder: str, tokens_per_sample: torch.Tensor, microbatch: int
    ) -> torch.Tensor:
        """Receive the gradient of this encoder rank's embeddings."""
        ...

    def destroy(self) -> None:
        """Release the communicator's process groups, if any."""
        ...


def _wait_all(works: list[Any]) -> None:
    for work in works:
        if work is not None:
            work.wait()


def _check_rows(
    what: str, encoder: str, tensor: torch.Tensor, tokens_per_sample: torch.Tensor, hidden: int
) -> None:
    expected = int(tokens_per_sample.sum())
    if tensor.dim() != 2 or tensor.size(0) != expected or tensor.size(1) != hidden:
        raise ValueError(
            f"{what} of encoder {encoder!r} has shape {tuple(tensor.shape)}, expected "
            f"[{expected}, {hidden}] (rows = the encoder's special tokens in this rank's "
            f"samples {tokens_per_sample.tolist()}, columns = the language model's hidden size); "
            f"the encoder must emit one row per special token, grouped by sample"
        )


class P2PModuleCommunicator:
    """Cross-module transfers with ``torch.distributed`` point-to-point ops.

    Args:
        infra: The (non-colocated) infra of this job.
        micro_batch_size: Samples per global micro-batch.
        hidden_size: Width of the embeddings (the language model's hidden size).
        dtype: dtype of the embeddings on the wire.
        device: Device of the receive buffers; default: CUDA's current device under nccl,
            else CPU.
        group: Process group whose ranks are the global ranks; default: the world.

    Raises:
        ValueError: The layout is colocated or the micro-batch size does not divide.
    """

    max_outstanding_forwards = 1

    def __init__(
        self,
        infra: MegatronMIMOInfra,
        micro_batch_size: int,
        hidden_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.plan = CrossModulePlan(infra.layout, micro_batch_size)
        self.infra = infra
        self.hidden_size = hidden_size
        self.dtype = dtype
        if device is None:
            nccl = dist.get_backend(group) == "nccl"
            device = (
                torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
            )
        self.device = device
        self.group = group
        self.rank = dist.get_rank()

    def _local(
        self, module: str, encoder: str, *, of_encoder: bool
    ) -> tuple[int, list[SampleTransfer]]:
        dp_rank = self.infra.dp_rank(module)
        start, _ = self.plan.sample_slice(module, dp_rank)
        return start, self.plan.peers(encoder, dp_rank, of_encoder=of_encoder)

    def send_forward(
        self, encoder: str, output: torch.Tensor, tokens_per_sample: torch.Tensor, microbatch: int
    ) -> PendingSends:
        """See :class:`ModuleCommunicator`. Only the replica's leader sends; returns at once."""
        _check_rows("output", encoder, output, tokens_per_sample, self.hidden_size)
        start, transfers = self._local(encoder, encoder, of_encoder=True)
        pending = PendingSends()
        if transfers and transfers[0].src_leader != self.rank:
            return pending
        payload = output.detach().to(self.dtype)
        for t, (lo, hi) in zip(
            transfers, row_ranges(transfers, start, tokens_per_sample), strict=True
        ):
            chunk = payload[lo:hi].contiguous()
            for dst in t.dst_ranks:
                pending.add(dist.isend(chunk, dst, group=self.group, tag=microbatch))
            pending.keep(chunk)
        return pending

    def recv_forward(
        self, encoder: str, tokens_per_sample: torch.Tensor, microbatch: int
    ) -> torch.Tensor:
        """See :class:`ModuleCommunicator`."""
        start, transfers = self._local(self.infra.language_module_name, encoder, of_encoder=False)
        rows = int(tokens_per_sample.sum())
        buffer = torch.empty(rows, self.hidden_size, dtype=self.dtype, device=self.device)
        works = [
            dist.irecv(buffer[lo:hi], t.src_leader, group=self.group, tag=microbatch)
            for t, (lo, hi) in zip(
                transfers, row_ranges(transfers, start, tokens_per_sample), strict=True
            )
        ]
        _wait_all(works)
        return buffer.requires_grad_()

    def send_backward(
        self, encoder: str, grad: torch.Tensor, tokens_per_sample: torch.Tensor, microbatch: int
    ) -> PendingSends:
        """See :class:`ModuleCommunicator`. Only the language replica's leader sends."""
        _check_rows("embedding gradient", encoder, grad, tokens_per_sample, self.hidden_size)
        start, transfers = self._local(self.infra.language_module_name, encoder, of_encoder=False)
        pending = PendingSends()
        if transfers and transfers[0].dst_leader != self.rank:
            return pending
        payload = grad.detach().to(self.dtype)
        for t, (lo, hi) in zip(
            transfers, row_ranges(transfers, start, tokens_per_sample), strict=True
        ):
            chunk = payload[lo:hi].contiguous()
            for dst in t.src_ranks:
                pending.add(dist.isend(chunk, dst, group=self.group, tag=microbatch))
            pending.keep(chunk)
        return pending

    def recv_backward(
        self, encoder: str, tokens_per_sample: torch.Tensor, microbatch: int
    ) -> torch.Tensor:
        """See :class:`ModuleCommunicator`."""
        start, transfers = self._local(encoder, encoder, of_encoder=True)
        rows = int(tokens_per_sample.sum())
        buffer = torch.empty(rows, self.hidden_size, dtype=self.dtype, device=self.device)
        works = [
            dist.irecv(buffer[lo:hi], t.dst_leader, group=self.group, tag=microbatch)
            for t, (lo, hi) in zip(
                transfers, row_ranges(transfers, start, tokens_per_sample), strict=True
            )
        ]
        _wait_all(works)
        return buffer

    def destroy(self) -> None:
        """Nothing to release: the world group carries the transfers."""


class MegatronBridgeModuleCommunicator:
    """The data path through megatron-core's ``BridgeCommunicator`` (one per encoder).

    megatron-core's communicator sends from each encoder replica's leader to the language
    replicas' leaders and broadcasts inside each replica; it pairs replicas in data-parallel
    order, which is the same sample ownership as :class:`~bridge.mimo.comm_plan.CrossModulePlan`.
    Per-peer row counts are attached to every tensor (``_mimo_bridge_split_sizes``), so
    samples with different numbers of embedding rows split correctly in both directions.
    Its sends block, so an encoder finishes one micro-batch before starting the next.

    Construction is collective (it creates process groups): call it on every rank.

    Args:
        infra: The (non-colocated) infra of this job.
        micro_batch_size: Samples per global micro-batch.
        hidden_size: Width of the embeddings (the language model's hidden size).
        dtype: dtype of the embeddings on the wire.
        allow_cpu_compat: Without CUDA, run megatron's nccl-only code on gloo through
            ``core_utils.cuda_compat`` instead of refusing (meant for tests on CPU).

    Raises:
        RuntimeError: CUDA is absent and ``allow_cpu_compat`` is false.
        ValueError: The data-parallel sizes of an encoder and the language model are not
            multiples of each other (megatron's communicator pairs replicas that way).
    """

    max_outstanding_forwards = 0

    def __init__(
        self,
        infra: MegatronMIMOInfra,
        micro_batch_size: int,
        hidden_size: int,
        dtype: torch.dtype = torch.float32,
        *,
        allow_cpu_compat: bool = False,
    ) -> None:
        if not torch.cuda.is_available() and not allow_cpu_compat:
            raise RuntimeError(
                "megatron-core's BridgeCommunicator requires CUDA (it creates nccl process "
                "groups and CUDA buffers); use communicator='p2p' (P2PModuleCommunicator) on CPU"
            )
        self.plan = CrossModulePlan(infra.layout, micro_batch_size)
        self.infra = infra
        self.hidden_size = hidden_size
        self.dtype = dtype
        self._use_compat = not torch.cuda.is_available()
        language = infra.language_module_name
        lm_dp = infra.dp_size(language)
        for encoder in infra.encoder_module_names:
            enc_dp = infra.dp_size(encoder)
            if enc_dp % lm_dp and lm_dp % enc_dp:
                raise ValueError(
                    f"megatron's BridgeCommunicator needs one data-parallel size to be a "
                    f"multiple of the other; encoder {encoder!r} has dp={enc_dp}, "
                    f"{language!r} has dp={lm_dp}: use communicator='p2p'"
                )
        from megatron.core.pipeline_parallel.bridge_communicator import BridgeCommunicator

        self._comms: dict[str, Any] = {}
        with self._compat():
            for encoder in infra.encoder_module_names:
                self._comms[encoder] = BridgeCommunicator(
                    src_grid=infra.module_to_grid_map[encoder],
                    dest_grid=infra.module_to_grid_map[language],
                    comm_dtype=dtype,
                    src_module_name=encoder,
                    dest_module_name=language,
                    tensor_ndim=2,
                )

    @contextlib.contextmanager
    def _compat(self) -> Iterator[None]:
        if not self._use_compat:
            yield
            return
        from core_utils.cuda_compat import cpu_cuda_compat

        with cpu_cuda_compat():
            yield

    def _peer_rows(
        self, module: str, encoder: str, tokens_per_sample: torch.Tensor, *, of_encoder: bool
    ) -> list[int]:
        dp_rank = self.infra.dp_rank(module)
        start, _ = self.plan.sample_slice(module, dp_rank)
        transfers = self.plan.peers(encoder, dp_rank, of_encoder=of_encoder)
        return [hi - lo for lo, hi in row_ranges(transfers, start, tokens_per_sample)]

    def send_forward(
        self, encoder: str, output: torch.Tensor, tokens_per_sample: torch.Tensor, microbatch: int
    ) -> PendingSends:
        """See :class:`ModuleCommunicator`. Blocks until the peers received."""
        _check_rows("output", encoder, output, tokens_per_sample, self.hidden_size)
        payload = output.detach().to(self.dtype).contiguous()
        payload._mimo_bridge_split_sizes = self._peer_rows(  # type: ignore[attr-defined]
            encoder, encoder, tokens_per_sample, of_encoder=True
        )
        with self._compat():
            self._comms[encoder].send_forward(payload)
        return PendingSends()

    def recv_forward(
        self, encoder: str, tokens_per_sample: torch.Tensor, microbatch: int
    ) -> torch.Tensor:
        """See :class:`ModuleCommunicator`."""
        with self._compat():
            received = self._comms[encoder].recv_forward()
        # megatron returns a concatenation (not a leaf) when several encoder replicas feed
        # this rank; the language model needs a leaf whose .grad it can send back.
        embeddings = received.detach().requires_grad_()
        _check_rows("received embeddings", encoder, embeddings, tokens_per_sample, self.hidden_size)
        return embeddings

    def send_backward(
        self, encoder: str, grad: torch.Tensor, tokens_per_sample: torch.Tensor, microbatch: int
    ) -> PendingSends:
        """See :class:`ModuleCommunicator`. Blocks until the peers received."""
        _check_rows("embedding gradient", encoder, grad, tokens_per_sample, self.hidden_size)
        payload = grad.detach().to(self.dtype).contiguous()
        payload._mimo_bridge_split_sizes = self._peer_rows(  # type: ignore[attr-defined]
            self.infra.language_module_name, encoder, tokens_per_sample, of_encoder=False
        )
        with self._compat():
            self._comms[encoder].send_backward(payload)
        return PendingSends()

    def recv_backward(
        self, encoder: str, tokens_per_sample: torch.Tensor, microbatch: int
    ) -> torch.Tensor:
        """See :class:`ModuleCommunicator`."""
        with self._compat():
            grad = self._comms[encoder].recv_backward()
        _check_rows("received gradient", encoder, grad, tokens_per_sample, self.hidden_size)
        return grad

    def destroy(self) -> None:
        """Destroy the groups megatron's communicators cached (on every rank)."""
        from megatron.core.pipeline_parallel.bridge_communicator import BridgeCommunicator

        # megatron's own destroy_* helpers would pass the non-member sentinel of a group this
        # rank is not in to destroy_process_group; skip those.
        non_member = dist.GroupMember.NON_GROUP_MEMBER
        with self._compat():
            for cache in (
                BridgeCommunicator._broadcast_pg_cache,
                BridgeCommunicator._bridge_pg_cache,
            ):
                for pg in cache.values():
                    if pg is not None and pg is not non_member:
                        dist.destroy_process_group(pg)
                cache.clear()
        self._comms.clear()
