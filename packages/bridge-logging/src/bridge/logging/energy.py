"""GPU energy consumption through NVML (``LoggerConfig.log_energy``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from core_utils.distributed import collective_device, dist_ready

__all__ = ["EnergyMonitor"]


class EnergyMonitor:
    """Energy used by the GPUs of all ranks, read from NVML's cumulative energy counter.

    Each rank reads the counter of its current CUDA device (matched to NVML by UUID, so
    ``CUDA_VISIBLE_DEVICES`` is respected).

    Raises:
        RuntimeError: CUDA is not available (energy needs an NVIDIA GPU).
        ImportError: ``nvidia-ml-py`` is missing (``pip install bridge-logging[energy]``).
    """

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "LoggerConfig.log_energy needs an NVIDIA GPU and NVML (energy is read "
                "from the GPU's counter); set log_energy=False on CPU-only machines"
            )
        try:
            import pynvml
        except ImportError as exc:
            from bridge.logging.backends import install_command

            raise ImportError(
                "LoggerConfig.log_energy needs nvidia-ml-py; install it with "
                f"{install_command('energy')}"
            ) from exc
        self._nvml: Any = pynvml
        pynvml.nvmlInit()
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        self._handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{props.uuid}")
        self._last_mj = self._read_mj()

    def _read_mj(self) -> int:
        return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))

    def lap(self) -> float:
        """Joules used by all ranks' GPUs since the previous lap (or construction).

        A collective over the default group when torch.distributed is initialised.
        """
        now = self._read_mj()
        joules = (now - self._last_mj) / 1000.0
        self._last_mj = now
        if not dist_ready():
            return joules
        total = torch.tensor([joules], dtype=torch.float64, device=collective_device())
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return float(total.item())
