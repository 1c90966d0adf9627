"""Measured FLOPs of a MIMO training step, per module.

The FLOPs are counted, not estimated: a step runs under torch's ``FlopCounterMode``, which
adds up the matrix multiplications (and attention) every rank executes in forward and
backward, including inside megatron-core's tensor-parallel autograd functions. Each rank
counts its own work; the per-module totals are summed over the world, so they include
every data-parallel replica and tensor-parallel shard. torch has no formula for CPU flash
attention, so one is registered here (same counting as torch's CUDA attention formulas).

Which steps are measured is decided collectively: the FLOPs are summed over the world, so
every rank must measure (and reduce) in the same steps, whatever its own batch shapes.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from core_utils.distributed import collective_device

__all__ = ["StepFlopsMeter"]

_aten = torch.ops.aten


def _attention_flops(query_shape: Any, key_shape: Any, value_shape: Any) -> int:
    batch, heads, q_len, head_dim = query_shape
    k_len = key_shape[-2]
    v_dim = value_shape[-1]
    # scores = Q K^T and out = P V: one multiply-add (2 FLOPs) per term of each.
    return 2 * batch * heads * q_len * k_len * head_dim + 2 * batch * heads * q_len * k_len * v_dim


def _cpu_flash_forward(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return _attention_flops(query, key, value)


def _cpu_flash_backward(
    grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any
) -> int:
    # dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q: twice the forward multiplies.
    return 2 * _attention_flops(query, key, value)


def _custom_formulas() -> dict[Any, Any]:
    formulas: dict[Any, Any] = {}
    forward = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if forward is not None:
        formulas[forward] = _cpu_flash_forward
    if backward is not None:
        formulas[backward] = _cpu_flash_backward
    return formulas


def _claimed_flops(by_path: dict[str, float], marker: str) -> float:
    """FLOPs of the module whose path contains ``marker`` (counted once).

    MIMO calls its modality submodules' ``forward`` directly, so the counter may only see
    their children: sum the outermost paths at or below the marker.
    """
    paths = [p for p in by_path if p.endswith("." + marker) or f".{marker}." in p or p == marker]
    outermost = [p for p in paths if not any(p != q and p.startswith(q + ".") for q in paths)]
    return float(sum(by_path[p] for p in outermost))


class StepFlopsMeter:
    """Counts the FLOPs of training steps, once per distinct combination of batch shapes.

    Counting slows a step down (every op goes through Python), so a step is measured only
    when the batch shapes of *every* rank form a combination not seen before; later steps
    with the same combination reuse the count. Ranks agree on that (:meth:`needs_measurement`
    is one all-reduce), so every rank makes the same collectives even when only some ranks'
    shapes change (for example encoder ranks fed images of a new resolution while the
    language-model ranks see the same token shapes).

    On a rank that runs one module every counted FLOP is that module's. On a colocated rank
    (all modules in one forward) the forward FLOPs are attributed to modules by the module
    that executed them, and the backward FLOPs, which torch cannot attribute reliably, are
    split in the same proportions; the total stays exact.

    Args:
        module_names: All module names, in the same order on every rank.
    """

    def __init__(self, module_names: list[str]) -> None:
        self.module_names = list(module_names)
        self._local_ids: dict[Any, int] = {}
        self._cache: dict[tuple[int, ...], dict[str, float]] = {}
        self._step_key: tuple[int, ...] | None = None
        self._warned: set[str] = set()
        self._total = 0.0
        self._forward_by_path: dict[str, float] = {}
        self._forward_total = 0.0

    @property
    def measured_combinations(self) -> int:
        """How many distinct job-wide shape combinations were measured so far."""
        return len(self._cache)

    def needs_measurement(self, signature: Any) -> bool:
        """Whether this step must be measured, agreed over the world. Collective.

        Every rank calls it once per step, before the step, with the shapes of its own
        batches. The ranks exchange a small id of their shapes (one all-reduce of
        ``world_size`` integers), so the answer, and the key the step's FLOPs are cached
        under, are the same on every rank.

        Args:
            signature: A hashable description of this rank's batch shapes.

        Returns:
            True when the combination of every rank's shapes has not been measured yet.
        """
        local_id = self._local_ids.setdefault(signature, len(self._local_ids))
        ids = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=collective_device())
        ids[dist.get_rank()] = local_id
        dist.all_reduce(ids)
        self._step_key = tuple(int(v) for v in ids.tolist())
        return self._step_key not in self._cache

    def reset(self) -> None:
        """Forget the counts of the previous measured step."""
        self._total = 0.0
        self._forward_by_path = {}
        self._forward_total = 0.0

    @contextlib.contextmanager
    def count(self, *, forward: bool = False) -> Iterator[None]:
        """Count the FLOPs this rank executes inside the block.

        Args:
            forward: The block is a forward pass; its FLOPs are also recorded per module
                path (used to attribute FLOPs on colocated ranks).
        """
        counter = FlopCounterMode(display=False, custom_mapping=_custom_formulas())
        with counter:
            yield
        total = float(counter.get_total_flops())
        self._total += total
        if forward:
            self._forward_total += total
            for path, ops in counter.get_flop_counts().items():
                self._forward_by_path[path] = self._forward_by_path.get(path, 0.0) + sum(
                    ops.values()
                )

    def local_flops(self, modules: list[str], language: str) -> dict[str, float]:
        """This rank's counted FLOPs per module it runs.

        Args:
            modules: The modules this rank runs.
            language: Name of the language module (gets what no encoder path claims).
        """
        if len(modules) == 1:
            return {modules[0]: self._total}
        share: dict[str, float] = {}
        for name in modules:
            if name == language:
                continue
            share[name] = _claimed_flops(self._forward_by_path, f"modality_submodules.{name}")
        share[language] = max(self._forward_total - sum(share.values()), 0.0)
        forward_total = sum(share.values())
        if forward_total <= 0:
            return {language: self._total}
        return {name: self._total * value / forward_total for name, value in share.items()}

    def record(self, local_flops_by_module: dict[str, float]) -> dict[str, float]:
        """Sum this rank's per-module FLOPs over the world and cache them. Collective.

        Call it on every rank after a step for which :meth:`needs_measurement` returned
        True. A module that counted no FLOPs at all (one without matrix multiplications,
        say) is reported with 0 and a one-time warning; training goes on.

        Args:
            local_flops_by_module: FLOPs this rank executed, per module it runs.

        Returns:
            Module name -> FLOPs of one step over the whole job.

        Raises:
            RuntimeError: :meth:`needs_measurement` was not called for this step.
        """
        if self._step_key is None:
            raise RuntimeError("StepFlopsMeter.record() called before needs_measurement()")
        totals = torch.zeros(
            len(self.module_names), dtype=torch.float64, device=collective_device()
        )
        for index, name in enumerate(self.module_names):
            totals[index] = float(local_flops_by_module.get(name, 0.0))
        dist.all_reduce(totals)
        result = {name: float(totals[i]) for i, name in enumerate(self.module_names)}
        empty = [name for name, value in result.items() if value <= 0 and name not in self._warned]
        if empty:
            self._warned.update(empty)
            warnings.warn(
                f"no FLOPs were counted for module(s) {empty}: they ran no matrix "
                f"multiplication or attention under torch's FLOP counter, so their FLOPs are "
                f"reported as 0 (warned once per module)",
                RuntimeWarning,
                stacklevel=2,
            )
        self._cache[self._step_key] = result
        return result

    def cached(self) -> dict[str, float]:
        """The job-wide FLOPs per module of the current step's (measured) shape combination.

        Raises:
            RuntimeError: The current combination was never measured.
        """
        if self._step_key is None or self._step_key not in self._cache:
            raise RuntimeError(
                "StepFlopsMeter.cached(): the current step's shapes were not measured; call "
                "needs_measurement() first and record() when it returns True"
            )
        return self._cache[self._step_key]
