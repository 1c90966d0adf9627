"""The MIMO training step, and the MIMO run on the stack's one loop.

One step on every rank (non-colocated layout)::

    encoder ranks                               language-model ranks
    -------------                               --------------------
    for each micro-batch k:                     for each micro-batch k:
      emb_k = encoder(images_k)                   emb_k = recv_forward(k)       <- encoders
      send_forward(emb_k, k)  ----------------->  loss_k = LLM(text_k, emb_k)
      (one micro-batch ahead, then)               loss_k.backward()
      g_k = recv_backward(k)  <-----------------  send_backward(emb_k.grad, k)
      emb_k.backward(g_k)
    finalize grads over the encoder DP group    finalize grads over the LLM DP group
    (x encoder_dp / llm_dp)
    optimizer step (global grad norm shared over the world)

In a colocated layout every rank runs the whole model on its samples and nothing moves
between modules. The step measures its FLOPs (see :mod:`bridge.mimo.flops`) and reports the
loss of the global batch on every rank.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from bridge.mimo.communicator import (
    MegatronBridgeModuleCommunicator,
    ModuleCommunicator,
    P2PModuleCommunicator,
    PendingSends,
)
from bridge.mimo.communicator_choice import CommunicatorChoice, choose_communicator
from bridge.mimo.data import MimoDataLoader
from bridge.mimo.flops import StepFlopsMeter
from bridge.mimo.infra import MegatronMIMOInfra
from bridge.mimo.optimizer import MultiModuleOptimizer
from bridge.mimo.parallel_utils import (
    finalize_model_grads_multimodule,
    get_module_to_grid_tuple,
    multimodule_no_sync,
    unwrap_megatron_mimo_model,
    validate_data_loader_contract,
    validate_no_stub_ranks,
    zero_grad_buffer_for_multimodule,
)
from core_utils.callbacks import Callback, CallbackList
from core_utils.distributed import any_rank
from core_utils.loop import LoopContext, StepResult, run_loop

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer

__all__ = [
    "LossFn",
    "MimoLogFn",
    "MimoLogRecord",
    "MimoLogger",
    "MimoLoopContext",
    "MimoProgress",
    "MimoStepFunction",
    "MimoStepResult",
    "MimoTrainResult",
    "MimoTrainStep",
    "ParamScheduler",
    "ShouldStop",
    "masked_token_loss",
    "mimo_log_record",
    "train_mimo",
]

logger = logging.getLogger(__name__)


class LossFn(Protocol):
    """Turns the language model's output on a micro-batch slice into a loss.

    Called as ``loss_fn(output, loss_mask, batch)`` with the language model's output (with
    labels given, megatron's GPTModel returns the per-token loss ``[b, s]``), the loss mask
    the model returned, and the micro-batch. Returns ``(loss_sum, num_tokens)``: the *sum*
    of the per-token losses that count and how many there are. The step normalises.
    """

    def __call__(
        self, output: torch.Tensor, loss_mask: torch.Tensor, batch: Mapping[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def masked_token_loss(
    output: torch.Tensor, loss_mask: torch.Tensor, batch: Mapping[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of the per-token losses where ``loss_mask`` is 1, and the number of such tokens."""
    mask = loss_mask.to(torch.float32).reshape(-1)
    losses = output.to(torch.float32).reshape(-1)
    if losses.numel() != mask.numel():
        raise ValueError(
            f"language model output has {losses.numel()} per-token losses but the loss mask has "
            f"{mask.numel()} entries; pass labels so the model returns per-token losses"
        )
    return (losses * mask).sum(), mask.sum()


@dataclass(frozen=True)
class MimoStepResult:
    """Outcome of one training step (identical on every rank).

    Attributes:
        loss: Loss of the global batch (mean over loss tokens).
        update_successful: Whether the optimizer stepped (False on a non-finite norm).
        grad_norm: L2 norm of the whole model's gradient before clipping.
        num_loss_tokens: Loss tokens in the global batch.
        num_tokens: Language-model input tokens in the global batch.
        flops: Module name -> FLOPs of the step over the whole job (measured).
        step_time_s: Wall time of the slowest rank.
    """

    loss: float
    update_successful: bool
    grad_norm: float
    num_loss_tokens: int
    num_tokens: int
    flops: dict[str, float]
    step_time_s: float


def _tokens_per_sample(input_ids: torch.Tensor, token_id: int) -> torch.Tensor:
    return (input_ids == token_id).sum(dim=1).to(torch.long).cpu()


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, Mapping):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_device(v, device) for v in value)
    return value


def _signature(batches: Sequence[Any]) -> tuple[Any, ...]:
    def shapes(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return tuple(value.shape)
        if isinstance(value, Mapping):
            return tuple(sorted((k, shapes(v)) for k, v in value.items()))
        return None

    return tuple(shapes(b) for b in batches)


class MimoTrainStep:
    """A MIMO training step bound to a model, its infra and its optimizer.

    Construction validates the setup (no stub ranks, batch sizes divisible by every
    module's data-parallel size, a supported model) and builds the communicator; megatron's
    communicator is built collectively, so construct the step on every rank. The chosen
    communicator is in :attr:`communicator_choice` and logged (``bridge.mimo.training``
    logger, INFO, rank 0).

    Args:
        model: The (possibly wrapped) MimoModel built for ``infra``.
        infra: The job's infra.
        optimizer: The per-module optimizer.
        global_batch_size: Samples per step over all replicas.
        micro_batch_size: Samples per micro-batch over all replicas.
        per_token_loss: Normalise by the global number of loss tokens (exact for any loss
            mask) instead of averaging per-replica means (megatron's default; exact when
            every sample has as many loss tokens).
        loss_fn: See :class:`LossFn`.
        communicator: ``"auto"`` (megatron-core's BridgeCommunicator when CUDA is in use
            and the layout fits it, else point-to-point; see
            :func:`~bridge.mimo.choose_communicator`), ``"p2p"`` (torch.distributed
            point-to-point; CPU and GPU), ``"megatron"`` (megatron-core's
            BridgeCommunicator; CUDA) or an object implementing
            :class:`~bridge.mimo.ModuleCommunicator`.
        measure_flops: Count FLOPs on the first step of each combination of batch shapes
            over the ranks (decided collectively, see :class:`~bridge.mimo.StepFlopsMeter`).

    Raises:
        ValueError: A check of the setup fails (the message names the module or size).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        infra: MegatronMIMOInfra,
        optimizer: MultiModuleOptimizer,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        per_token_loss: bool = False,
        loss_fn: LossFn = masked_token_loss,
        communicator: str | ModuleCommunicator = "auto",
        measure_flops: bool = True,
    ) -> None:
        validate_no_stub_ranks(infra.module_to_grid_map, dist.get_world_size())
        num_microbatches = infra.layout.validate_batch_sizes(global_batch_size, micro_batch_size)
        validate_data_loader_contract(infra, global_batch_size, micro_batch_size, num_microbatches)
        self.model = model
        self.mimo = unwrap_megatron_mimo_model(model)
        self.infra = infra
        self.optimizer = optimizer
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.num_microbatches = num_microbatches
        self.per_token_loss = per_token_loss
        self.loss_fn = loss_fn
        self.language = infra.language_module_name
        self.special_token_ids = dict(self.mimo.special_token_ids)
        lm_config = self.mimo.mimo_config.language_model_spec.params["config"]
        if getattr(lm_config, "sequence_parallel", False):
            raise ValueError(
                "the language model config has sequence_parallel=True, which bridge-mimo's "
                "gradient finalisation does not support; set sequence_parallel=False"
            )
        self.hidden_size = int(lm_config.hidden_size)
        self.dtype = getattr(lm_config, "params_dtype", None) or torch.float32
        self.module_to_grid_tuple = get_module_to_grid_tuple(model, infra)
        for module, _grid in self.module_to_grid_tuple:
            if (
                isinstance(module, torch.nn.parallel.DistributedDataParallel)
                and num_microbatches > 1
            ):
                raise ValueError(
                    "torch DistributedDataParallel modules cannot accumulate encoder "
                    "micro-batches whose backward runs after later forwards; leave the modules "
                    "unwrapped (bridge-mimo reduces their gradients) or use megatron-core DDP"
                )
        self.no_sync_func = functools.partial(
            multimodule_no_sync, module_to_grid_tuple=self.module_to_grid_tuple
        )
        self.finalize_func = functools.partial(
            finalize_model_grads_multimodule,
            infra=infra,
            module_to_grid_tuple=self.module_to_grid_tuple,
        )
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend() == "nccl"
            else torch.device("cpu")
        )
        self.communicator: ModuleCommunicator | None = None
        self.communicator_choice = self._choose(communicator)
        if not infra.is_colocated:
            if isinstance(communicator, str):
                self.communicator = self._build_communicator(self.communicator_choice.kind)
            else:
                self.communicator = communicator
        if dist.get_rank() == 0:
            logger.info("bridge.mimo communicator: %s", self.communicator_choice.describe())
        self.flops_meter = StepFlopsMeter(list(infra.module_to_grid_map)) if measure_flops else None
        self._measuring = False

    def _choose(self, communicator: str | ModuleCommunicator) -> CommunicatorChoice:
        if isinstance(communicator, str) and communicator not in ("auto", "p2p", "megatron"):
            raise ValueError(
                f"communicator must be 'auto', 'p2p', 'megatron' or a ModuleCommunicator, got "
                f"{communicator!r}"
            )
        if communicator == "auto" or self.infra.is_colocated:
            return choose_communicator(self.device.type == "cuda", self.infra.layout)
        if not isinstance(communicator, str):
            return CommunicatorChoice("custom", f"given: {type(communicator).__name__}")
        if communicator == "megatron":
            return CommunicatorChoice("megatron", "asked for explicitly")
        return CommunicatorChoice("p2p", "asked for explicitly")

    def _build_communicator(self, kind: str) -> ModuleCommunicator:
        if kind == "megatron":
            return MegatronBridgeModuleCommunicator(
                self.infra, self.micro_batch_size, self.hidden_size, self.dtype
            )
        return P2PModuleCommunicator(
            self.infra, self.micro_batch_size, self.hidden_size, self.dtype
        )

    # -- one micro-batch at a time -------------------------------------------------------

    def _no_sync_unless_last(self, index: int) -> contextlib.AbstractContextManager[None]:
        if index < self.num_microbatches - 1:
            return self.no_sync_func()
        return contextlib.nullcontext()

    def _position_ids(self, batch: Mapping[str, Any]) -> torch.Tensor:
        if batch.get("position_ids") is not None:
            return batch["position_ids"]
        input_ids = batch["input_ids"]
        return torch.arange(input_ids.size(1), device=input_ids.device).expand_as(input_ids)

    def _language_loss(
        self, output: Any, loss_mask: torch.Tensor, batch: Mapping[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if loss_mask is None:
            loss_mask = batch["loss_mask"]
        loss_sum, num_tokens = self.loss_fn(output, loss_mask, batch)
        if self.per_token_loss:
            objective = loss_sum
        else:
            # Megatron's convention: mean over this replica's tokens, averaged over
            # micro-batches here and over data-parallel replicas by finalize.
            objective = loss_sum / num_tokens.clamp(min=1) / self.num_microbatches
        return objective, loss_sum.detach(), num_tokens.detach()

    def _run_encoder(self, name: str, batches: Sequence[Mapping[str, Any]]) -> list[PendingSends]:
        assert self.communicator is not None
        comm = self.communicator
        token_id = self.special_token_ids[name]
        pending: list[PendingSends] = []
        in_flight: deque[tuple[int, torch.Tensor, torch.Tensor]] = deque()

        def backward_oldest() -> None:
            index, output, counts = in_flight.popleft()
            grad = comm.recv_backward(name, counts, index).to(output.dtype)
            with self._no_sync_unless_last(index):
                torch.autograd.backward(output, grad)

        for index, batch in enumerate(batches):
            counts = _tokens_per_sample(batch["input_ids"], token_id)
            outputs, _ = self.model(
                input_ids=batch["input_ids"], modality_inputs=batch.get("modality_inputs")
            )
            output = outputs[name]
            pending.append(comm.send_forward(name, output, counts, index))
            in_flight.append((index, output, counts))
            while len(in_flight) > comm.max_outstanding_forwards:
                backward_oldest()
        while in_flight:
            backward_oldest()
        return pending

    def _run_language(
        self, batches: Sequence[Mapping[str, Any]]
    ) -> tuple[list[PendingSends], torch.Tensor, torch.Tensor, int]:
        assert self.communicator is not None
        comm = self.communicator
        pending: list[PendingSends] = []
        loss_value = torch.zeros((), dtype=torch.float64)
        loss_tokens = torch.zeros((), dtype=torch.float64)
        input_tokens = 0
        encoders = self.infra.encoder_module_names
        for index, batch in enumerate(batches):
            counts = {
                name: _tokens_per_sample(batch["input_ids"], self.special_token_ids[name])
                for name in encoders
            }
            embeddings = {name: comm.recv_forward(name, counts[name], index) for name in encoders}
            self.mimo.set_input_tensor(embeddings)
            output, loss_mask = self.model(
                input_ids=batch["input_ids"],
                position_ids=self._position_ids(batch),
                attention_mask=None,
                loss_mask=batch["loss_mask"],
                labels=batch["labels"],
            )
            objective, loss_sum, num_tokens = self._language_loss(output, loss_mask, batch)
            with self._no_sync_unless_last(index):
                objective.backward()
            for name in encoders:
                grad = embeddings[name].grad
                if grad is None:
                    grad = torch.zeros_like(embeddings[name])
                pending.append(comm.send_backward(name, grad, counts[name], index))
            loss_value += self._loss_contribution(loss_sum, num_tokens)
            loss_tokens += num_tokens.double().cpu()
            input_tokens += batch["input_ids"].numel()
        self.mimo.input_tensors = None  # drop references to this step's embeddings
        return pending, loss_value, loss_tokens, input_tokens

    def _run_colocated(
        self, batches: Sequence[Mapping[str, Any]]
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        loss_value = torch.zeros((), dtype=torch.float64)
        loss_tokens = torch.zeros((), dtype=torch.float64)
        input_tokens = 0
        for index, batch in enumerate(batches):
            with self._count(forward=True):
                output, loss_mask = self.model(
                    input_ids=batch["input_ids"],
                    position_ids=self._position_ids(batch),
                    attention_mask=None,
                    loss_mask=batch["loss_mask"],
                    labels=batch["labels"],
                    modality_inputs=batch.get("modality_inputs"),
                )
            objective, loss_sum, num_tokens = self._language_loss(output, loss_mask, batch)
            with self._no_sync_unless_last(index), self._count(forward=False):
                objective.backward()
            loss_value += self._loss_contribution(loss_sum, num_tokens)
            loss_tokens += num_tokens.double().cpu()
            input_tokens += batch["input_ids"].numel()
        return loss_value, loss_tokens, input_tokens

    def _count(self, *, forward: bool) -> contextlib.AbstractContextManager[None]:
        if self._measuring and self.flops_meter is not None:
            return self.flops_meter.count(forward=forward)
        return contextlib.nullcontext()

    def _loss_contribution(self, loss_sum: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
        if self.per_token_loss:
            return loss_sum.double().cpu()
        # Each replica's share of the mean over replicas and micro-batches.
        mean = loss_sum.double().cpu() / num_tokens.double().cpu().clamp(min=1)
        return mean / self.num_microbatches / self.infra.dp_size(self.language)

    # -- the step ------------------------------------------------------------------------

    def __call__(self, microbatches: Sequence[Mapping[str, Any]]) -> MimoStepResult:
        """Run one step on this rank's slices of the global batch's micro-batches.

        Args:
            microbatches: ``num_microbatches`` batches (see :class:`MimoDataLoader`), each
                with ``input_ids``, ``labels``, ``loss_mask`` (``[b, s]``), optional
                ``position_ids``, and ``modality_inputs`` (encoder ranks).

        Returns:
            The step's result, identical on every rank.

        Raises:
            ValueError: The number of micro-batches is wrong.
        """
        if len(microbatches) != self.num_microbatches:
            raise ValueError(
                f"expected {self.num_microbatches} micro-batches (global_batch_size="
                f"{self.global_batch_size} / micro_batch_size={self.micro_batch_size}), got "
                f"{len(microbatches)}"
            )
        start = time.perf_counter()
        batches = [_to_device(b, self.device) for b in microbatches]
        # Collective (every rank, every step): FLOPs are summed over the world, so all ranks
        # must measure the same steps even when only some ranks' shapes changed.
        measure = self.flops_meter is not None and self.flops_meter.needs_measurement(
            _signature(batches)
        )
        zero_grad_buffer_for_multimodule(self.module_to_grid_tuple)
        self.optimizer.zero_grad()

        self._measuring = measure
        if measure and self.flops_meter is not None:
            self.flops_meter.reset()
        # A colocated rank counts forward and backward separately (to attribute FLOPs to
        # modules); a single-module rank counts the whole pass.
        whole = measure and self.flops_meter is not None and not self.infra.is_colocated
        with self.flops_meter.count() if whole and self.flops_meter else contextlib.nullcontext():
            loss_value, loss_tokens, input_tokens, local_tokens = self._forward_backward(batches)

        num_tokens_arg = local_tokens if self.per_token_loss else None
        self.finalize_func([self.model], num_tokens_arg)
        ok, grad_norm, _ = self.optimizer.step()
        step_time = time.perf_counter() - start

        stats = torch.tensor(
            [float(loss_value), float(loss_tokens), float(input_tokens)], dtype=torch.float64
        )
        timing = torch.tensor([step_time], dtype=torch.float64)
        if self.device.type == "cuda":
            stats, timing = stats.to(self.device), timing.to(self.device)
        dist.all_reduce(stats)
        dist.all_reduce(timing, op=dist.ReduceOp.MAX)
        total_loss, total_loss_tokens, total_input_tokens = (float(v) for v in stats.tolist())
        loss = total_loss / total_loss_tokens if self.per_token_loss else total_loss
        if self.per_token_loss and total_loss_tokens == 0:
            loss = math.nan

        flops: dict[str, float] = {}
        if self.flops_meter is not None:
            if measure:
                flops = self.flops_meter.record(self._local_flops_by_module())
            else:
                flops = self.flops_meter.cached()
        return MimoStepResult(
            loss=loss,
            update_successful=ok,
            grad_norm=grad_norm,
            num_loss_tokens=round(total_loss_tokens),
            num_tokens=round(total_input_tokens),
            flops=flops,
            step_time_s=float(timing.item()),
        )

    def _forward_backward(
        self, batches: Sequence[Mapping[str, Any]]
    ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
        """Run every micro-batch; returns this rank's loss/token contributions."""
        zero = torch.zeros((), dtype=torch.float64)
        counts_here = self._counts_for_reporting()
        if self.infra.is_colocated:
            loss_value, loss_tokens, input_tokens = self._run_colocated(batches)
            local_tokens = loss_tokens.clone()
        elif self.language in self.infra.participating_modules:
            pending, loss_value, loss_tokens, input_tokens = self._run_language(batches)
            for sends in pending:
                sends.wait()
            local_tokens = loss_tokens.clone()
        else:
            (name,) = self.infra.participating_modules
            for sends in self._run_encoder(name, batches):
                sends.wait()
            loss_value, loss_tokens, input_tokens, local_tokens = zero, zero, 0, zero
        if not counts_here:
            # Tensor-parallel followers hold copies of their leader's numbers.
            return zero, zero, 0, local_tokens
        return loss_value, loss_tokens, input_tokens, local_tokens

    def _counts_for_reporting(self) -> bool:
        """Whether this rank's loss/token numbers enter the job-wide sums."""
        if self.language not in self.infra.participating_modules:
            return False
        return self.infra.tp_rank(self.language) == 0

    def _local_flops_by_module(self) -> dict[str, float]:
        assert self.flops_meter is not None
        return self.flops_meter.local_flops(self.infra.participating_modules, self.language)

    def close(self) -> None:
        """Release the communicator."""
        if self.communicator is not None:
            self.communicator.destroy()
            self.communicator = None


@dataclass(frozen=True)
class MimoLogRecord:
    """What :func:`train_mimo` reports every ``log_interval`` iterations (on every rank).

    Attributes:
        iteration: Iterations completed.
        consumed_samples: Samples consumed so far.
        loss: Mean of the global-batch losses over the interval.
        learning_rate: Learning rate of the first parameter group on this rank, if any.
        grad_norm: Gradient norm of the last step.
        iteration_time_s: Mean step time over the interval (slowest rank).
        samples_per_sec: Global samples per second.
        tokens_per_sec: Language-model input tokens per second.
        flops_per_iteration: Module name -> measured FLOPs of one step over the job.
        tflops_per_sec: Job-wide TFLOP/s (all modules, all ranks).
        tflops_per_sec_per_rank: ``tflops_per_sec`` divided by the world size.
        skipped_iterations: Steps in the interval whose update was skipped.
        world_size: Number of ranks.
    """

    iteration: int
    consumed_samples: int
    loss: float
    learning_rate: float | None
    grad_norm: float
    iteration_time_s: float
    samples_per_sec: float
    tokens_per_sec: float
    flops_per_iteration: dict[str, float]
    tflops_per_sec: float
    tflops_per_sec_per_rank: float
    skipped_iterations: int
    world_size: int

    def as_metrics(self) -> dict[str, float]:
        """Flat metric names (megatron / Megatron-Bridge spelling) -> values."""
        metrics = {
            "lm loss": self.loss,
            "grad-norm": self.grad_norm,
            "iteration-time": self.iteration_time_s,
            "consumed-samples": float(self.consumed_samples),
            "skipped-iterations": float(self.skipped_iterations),
            "throughput/samples_per_sec": self.samples_per_sec,
            "throughput/tokens_per_sec": self.tokens_per_sec,
            "throughput/device/samples_per_sec": self.samples_per_sec / self.world_size,
            "throughput/device/tokens_per_sec": self.tokens_per_sec / self.world_size,
            "throughput/tflops_per_sec": self.tflops_per_sec,
            "throughput/device/tflops_per_sec": self.tflops_per_sec_per_rank,
        }
        if self.learning_rate is not None:
            metrics["learning-rate"] = self.learning_rate
        for name, value in self.flops_per_iteration.items():
            metrics[f"flops/{name}"] = value
        return metrics

    def format(self) -> str:
        """One console line."""
        lr = "n/a" if self.learning_rate is None else f"{self.learning_rate:.3e}"
        return (
            f"iteration {self.iteration:6d} | consumed samples {self.consumed_samples:8d} | "
            f"loss {self.loss:.5f} | lr {lr} | grad norm {self.grad_norm:.3f} | "
            f"{self.iteration_time_s * 1e3:.1f} ms/it | {self.samples_per_sec:.1f} samples/s | "
            f"{self.tokens_per_sec:.0f} tokens/s | {self.tflops_per_sec * 1e3:.3f} GFLOP/s "
            f"({', '.join(f'{k} {v / 1e9:.2f} GFLOP' for k, v in self.flops_per_iteration.items())}"
            f" per iteration)"
            + (f" | skipped {self.skipped_iterations}" if self.skipped_iterations else "")
        )


class MimoLogFn(Protocol):
    """Receives a :class:`MimoLogRecord` every ``log_interval`` iterations, on every rank.

    bridge-train plugs its metric writers in here; a script can print ``record.format()``
    on one rank.
    """

    def __call__(self, record: MimoLogRecord) -> None: ...


@dataclass
class MimoTrainResult:
    """What :func:`train_mimo` did.

    Attributes:
        iteration: Iterations completed (including ``start_iteration``).
        consumed_samples: Samples consumed so far.
        losses: Global-batch loss of every iteration run by this call.
        skipped_iterations: Iterations whose update was skipped.
        stopped_early: ``should_stop`` ended the run before ``train_iters``.
    """

    iteration: int
    consumed_samples: int
    losses: list[float] = field(default_factory=list)
    skipped_iterations: int = 0
    stopped_early: bool = False


class ParamScheduler(Protocol):
    """What :func:`train_mimo` needs of a learning-rate scheduler (megatron-core's
    ``OptimizerParamScheduler`` fits): ``step(increment)`` after every successful update."""

    def step(self, increment: int) -> None: ...


class ShouldStop(Protocol):
    """Asked after every iteration, on every rank, whether training should stop now.

    Called as ``should_stop(iteration)`` with the number of iterations completed. bridge-train
    passes its exit conditions here (``train.exit_interval``, ``train.exit_duration_in_mins``).
    :func:`train_mimo` stops when any rank's answer is True (it reduces the answers over the
    world), so a rank-local clock cannot make ranks disagree.
    """

    def __call__(self, iteration: int) -> bool: ...


def mimo_log_record(
    window: Sequence[MimoStepResult],
    *,
    iteration: int,
    consumed_samples: int,
    global_batch_size: int,
    optimizer: MegatronOptimizer,
    world_size: int,
) -> MimoLogRecord:
    """The :class:`MimoLogRecord` of the steps in ``window`` (the last logging interval).

    Args:
        window: Results of the interval's steps, oldest first (at least one).
        iteration: Iterations completed.
        consumed_samples: Samples consumed so far.
        global_batch_size: Samples per step.
        optimizer: Its first parameter group's learning rate is reported.
        world_size: Number of ranks.
    """
    last = window[-1]
    elapsed = sum(o.step_time_s for o in window)
    samples = global_batch_size * len(window)
    tokens = sum(o.num_tokens for o in window)
    flops_total = sum(sum(o.flops.values()) for o in window)
    groups = optimizer.param_groups
    return MimoLogRecord(
        iteration=iteration,
        consumed_samples=consumed_samples,
        loss=sum(o.loss for o in window) / len(window),
        learning_rate=float(groups[0]["lr"]) if groups else None,
        grad_norm=last.grad_norm,
        iteration_time_s=elapsed / len(window),
        samples_per_sec=samples / elapsed if elapsed > 0 else math.inf,
        tokens_per_sec=tokens / elapsed if elapsed > 0 else math.inf,
        flops_per_iteration=dict(last.flops),
        tflops_per_sec=flops_total / elapsed / 1e12 if elapsed > 0 else math.inf,
        tflops_per_sec_per_rank=(
            flops_total / elapsed / 1e12 / world_size if elapsed > 0 else math.inf
        ),
        skipped_iterations=sum(not o.update_successful for o in window),
        world_size=world_size,
    )


@dataclass
class MimoProgress:
    """The progress counters of a MIMO loop (:class:`core_utils.loop.TrainProgress`).

    Attributes:
        step: Iterations completed.
        consumed_train_samples: Samples consumed so far.
        skipped_train_samples: Samples of iterations whose update was skipped.
        floating_point_operations_so_far: Measured FLOPs of the steps run so far.
    """

    step: int = 0
    consumed_train_samples: int = 0
    skipped_train_samples: int = 0
    floating_point_operations_so_far: float = 0.0


class MimoStepFunction:
    """One MIMO iteration as the loop's step (``LoopContext -> StepResult``).

    Runs ``step`` on this rank's next micro-batches, steps the scheduler by the global batch
    (megatron's sample-based schedule) when the update was applied, and keeps the step's own
    result (:attr:`outcome`) and every loss for the MIMO components. ``train_mimo`` and
    bridge-train's ``mimo`` recipe both run it on :func:`core_utils.loop.run_loop`.

    Args:
        step: The bound training step.
        data: This rank's loader.
        scheduler: Optional LR scheduler.

    Attributes:
        outcome: The latest step's result (``None`` before the first step).
        losses: Global-batch loss of every step run.
        skipped_iterations: Steps whose update was skipped.
    """

    def __init__(
        self, step: MimoTrainStep, data: MimoDataLoader, scheduler: ParamScheduler | None = None
    ) -> None:
        self.step = step
        self.data = data
        self.scheduler = scheduler
        self.outcome: MimoStepResult | None = None
        self.losses: list[float] = []
        self.skipped_iterations = 0

    def __call__(self, context: LoopContext) -> StepResult:
        """Run one iteration."""
        outcome = self.step(next(self.data))
        self.outcome = outcome
        self.losses.append(outcome.loss)
        gbs = self.data.global_batch_size
        if outcome.update_successful:
            if self.scheduler is not None:
                self.scheduler.step(increment=gbs)
        else:
            self.skipped_iterations += 1
        return StepResult(
            losses={"lm loss": torch.tensor(outcome.loss, dtype=torch.float64)},
            skipped=not outcome.update_successful,
            grad_norm=outcome.grad_norm,
            num_samples=gbs,
            flops=float(sum(outcome.flops.values())),
        )


class MimoLogger(Callback):
    """A loop component: a :class:`MimoLogRecord` to ``log_fn`` every ``log_interval``
    iterations and at ``train_iters``, and for the partial interval when the loop stops
    earlier.

    Args:
        step_function: The loop's step (its outcomes are logged).
        log_fn: Receives every record (on every rank).
        log_interval: Iterations per record.
        train_iters: The run's last iteration (always logged).
    """

    def __init__(
        self,
        step_function: MimoStepFunction,
        log_fn: MimoLogFn | Callable[[MimoLogRecord], None],
        log_interval: int,
        train_iters: int,
    ) -> None:
        self.step_function = step_function
        self.log_fn = log_fn
        self.log_interval = log_interval
        self.train_iters = train_iters
        self.window: list[MimoStepResult] = []

    def _emit(self, iteration: int) -> None:
        step = self.step_function
        self.log_fn(
            mimo_log_record(
                self.window,
                iteration=iteration,
                consumed_samples=step.data.consumed_samples,
                global_batch_size=step.data.global_batch_size,
                optimizer=step.step.optimizer,
                world_size=dist.get_world_size(),
            )
        )
        self.window = []

    def on_step_end(self, context: LoopContext) -> None:
        """Log on the interval and at the last iteration."""
        outcome = self.step_function.outcome
        assert outcome is not None
        self.window.append(outcome)
        iteration = context.iteration
        if iteration % self.log_interval == 0 or iteration == self.train_iters:
            self._emit(iteration)

    def on_train_end(self, context: LoopContext) -> None:
        """Log the partial interval of a run that stopped early."""
        if self.window:
            self._emit(context.iteration)


class _StopWhenAsked(Callback):
    """Stops the loop after the first iteration for which any rank's ``should_stop`` holds
    (one all-reduce per iteration, so a rank-local clock cannot make ranks disagree)."""

    def __init__(self, should_stop: ShouldStop | Callable[[int], bool]):
        self.should_stop = should_stop

    def on_step_end(self, context: LoopContext) -> None:
        if any_rank(self.should_stop(context.iteration)):
            context.request_stop("should_stop asked to stop")


@dataclass(eq=False, kw_only=True)
class MimoLoopContext(LoopContext):
    """What :func:`train_mimo` hands to every callback hook: the shared loop's
    :class:`core_utils.loop.LoopContext` plus the MIMO run's own objects.

    Attributes:
        step_function: The loop's step (its bound training step, loader and outcomes).
        train_iters: Iteration the loop stops at.
    """

    step_function: MimoStepFunction
    train_iters: int

    @property
    def step(self) -> MimoTrainStep:
        """The bound training step (model, infra, optimizer)."""
        return self.step_function.step

    @property
    def data(self) -> MimoDataLoader:
        """The rank's loader (its ``consumed_samples`` is the resume position)."""
        return self.step_function.data

    @property
    def consumed_samples(self) -> int:
        """Samples consumed so far."""
        return int(self.train_state.consumed_train_samples)

    @property
    def outcome(self) -> MimoStepResult | None:
        """The last step's result (``None`` before the first step)."""
        return self.step_function.outcome

    @property
    def result(self) -> MimoTrainResult:
        """The run so far, as :func:`train_mimo` returns it."""
        step = self.step_function
        iteration = self.iteration
        return MimoTrainResult(
            iteration=iteration,
            consumed_samples=step.data.consumed_samples,
            losses=list(step.losses),
            skipped_iterations=step.skipped_iterations,
            stopped_early=self.stop_requested and iteration < self.train_iters,
        )


def train_mimo(
    step: MimoTrainStep,
    data: MimoDataLoader,
    *,
    train_iters: int,
    scheduler: ParamScheduler | None = None,
    log_fn: MimoLogFn | Callable[[MimoLogRecord], None] | None = None,
    log_interval: int = 1,
    start_iteration: int = 0,
    should_stop: ShouldStop | Callable[[int], bool] | None = None,
    callbacks: Sequence[Callback] | CallbackList | None = None,
) -> MimoTrainResult:
    """Train until ``train_iters`` iterations are done. Collective: call on every rank.

    The loop is the stack's one training loop, :func:`core_utils.loop.run_loop`, with
    :class:`MimoStepFunction` as its step: each iteration takes this rank's micro-batches
    from ``data``, runs ``step``, advances the scheduler by the global batch size
    (megatron's convention: warmup and decay counted in samples), and every
    ``log_interval`` iterations :class:`MimoLogger` calls ``log_fn`` with a
    :class:`MimoLogRecord`. With ``should_stop``, the loop also ends after the first
    iteration for which any rank's ``should_stop`` says so (the partial logging interval is
    logged at the end).

    Args:
        step: The bound training step (model, infra, optimizer, loss normalisation).
        data: This rank's loader; its batch sizes must match the step's.
        train_iters: Iteration to stop at (counting ``start_iteration``).
        scheduler: Optional LR scheduler, e.g. megatron-core's ``OptimizerParamScheduler``
            over the step's optimizer.
        log_fn: Optional callback for log records.
        log_interval: Iterations per log record.
        start_iteration: Iterations already done (when resuming).
        should_stop: Optional early-exit check (see :class:`ShouldStop`); one all-reduce
            per iteration when given.
        callbacks: ``core_utils.Callback`` objects called in order with a
            :class:`MimoLoopContext` (after the loop's own components): ``on_train_start``,
            ``on_step_start`` / ``on_step_end`` around every step (after the scheduler
            step), ``on_train_end`` when the loop ends (not on an error). A callback ends
            the run with ``context.request_stop(reason)``.

    Returns:
        The iterations done, the samples consumed, the per-iteration losses and whether
        the run stopped before ``train_iters``.

    Raises:
        ValueError: Batch sizes of ``data`` and ``step`` differ, or an interval is invalid.
    """
    if (
        data.global_batch_size != step.global_batch_size
        or data.micro_batch_size != step.micro_batch_size
    ):
        raise ValueError(
            f"data loader batch sizes (global {data.global_batch_size}, micro "
            f"{data.micro_batch_size}) differ from the step's (global {step.global_batch_size}, "
            f"micro {step.micro_batch_size})"
        )
    if log_interval < 1:
        raise ValueError(f"log_interval must be >= 1, got {log_interval}")
    if train_iters < start_iteration:
        raise ValueError(f"train_iters={train_iters} is below start_iteration={start_iteration}")
    step_function = MimoStepFunction(step, data, scheduler)
    components: list[Callback] = []
    if should_stop is not None:
        components.append(_StopWhenAsked(should_stop))
    if log_fn is not None:
        components.append(MimoLogger(step_function, log_fn, log_interval, train_iters))
    hooks = CallbackList(components, list(callbacks or ()))
    context = MimoLoopContext(
        train_state=MimoProgress(
            step=start_iteration, consumed_train_samples=data.consumed_samples
        ),
        model=[step.model],
        optimizer=step.optimizer,
        scheduler=scheduler,
        train_data_iterator=data,
        callbacks=hooks,
        step_function=step_function,
        train_iters=train_iters,
    )
    run_loop(context, step_function, lambda c: c.iteration >= train_iters)
    return context.result
