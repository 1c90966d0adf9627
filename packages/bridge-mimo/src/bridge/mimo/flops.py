"""Measured FLOPs of a MIMO training step, per module.

The FLOPs are counted, not estimated: a step runs under torch's ``FlopCounterMode``, which
adds up the matrix multiplications (and attention) every rank executes in forward and
backward, including inside megatron-core's tensor-parallel autograd functions. Each rank
counts its own work; the per-module totals are summed over the world, so they include
every data-parallel replica and tensor-parallel shard. torch has no formula for CPU flash
attention, so one is registered here (same counting as torch's CUDA attention formulas).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

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
    """Counts the FLOPs of training steps, once per distinct batch shape.

    Counting slows a step down (every op goes through Python), so a step is measured only
    when its batch shapes (``signature``) were not seen before; later steps of the same shape
    reuse the count.

    On a rank that runs one module every counted FLOP is that module's. On a colocated rank
    (all modules in one forward) the forward FLOPs are attributed to modules by the module
    that executed them, and the backward FLOPs, which torch cannot attribute reliably, are
    split in the same proportions; the total stays exact.

    Args:
        module_names: All module names, in the same order on every rank.
    """

    def __init__(self, module_names: list[str]) -> None:
        self.module_names = list(module_names)
        self._cache: dict[Any, dict[str, float]] = {}
        self._total = 0.0
        self._forward_by_path: dict[str, float] = {}
        self._forward_total = 0.0

    def needs_measurement(self, signature: Any) -> bool:
        """Whether a step with these batch shapes has not been measured yet."""
        return signature not in self._cache

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

    def record(self, signature: Any, local_flops_by_module: dict[str, float]) -> dict[str, float]:
        """Sum this rank's per-module FLOPs over the world and cache them. Collective.

        Args:
            signature: The step's batch-shape signature.
            local_flops_by_module: FLOPs this rank executed, per module it runs.

        Returns:
            Module name -> FLOPs of one step over the whole job.

        Raises:
            RuntimeError: No FLOPs were counted for a module (nothing was measured).
        """
        nccl = dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        totals = torch.zeros(len(self.module_names), dtype=torch.float64, device=device)
        for index, name in enumerate(self.module_names):
            totals[index] = float(local_flops_by_module.get(name, 0.0))
        dist.all_reduce(totals)
        result = {name: float(totals[i]) for i, name in enumerate(self.module_names)}
        empty = [name for name, value in result.items() if value <= 0]
        if empty:
            raise RuntimeError(
                f"no FLOPs were counted for module(s) {empty}; the step ran no matrix "
                f"multiplication for them under the FLOP counter"
            )
        self._cache[signature] = result
        return result

    def cached(self, signature: Any) -> dict[str, float]:
        """The job-wide FLOPs per module of a measured signature."""
        return self._cache[signature]
