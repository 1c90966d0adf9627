"""Find the slow ranks of a data-parallel job: per-rank timing, gathered and compared.

:class:`StragglerDetector` is a per-process singleton (also reachable as
``core_utils.__straggler__``). Each rank times a region of its step (typically the
forward-backward) and, separately, its data loading::

    stimer = StragglerDetector()
    stimer.configure(world_size, rank, port=65535, enabled=True)
    ...
    with stimer(bdata=True):
        batch = get_batch(data_iterator)
    with stimer:
        loss = forward_backward(batch)
    ...
    if iteration % log_interval == 0:
        stimer.report(total_flops=flops_in_interval, log_interval=log_interval)

:meth:`StragglerDetector.report` is a collective: every rank contributes its average time
per iteration, the slowest data-loading time, its estimated throughput and (on GPUs, with
``pip install core-utils[nvml]``) GPU temperature, power, utilisation and SM clock. Every
rank then knows the minimum and maximum of each metric and which rank holds it
(:attr:`StragglerDetector.last_report`); rank 0 logs them.

Timing: on CPU with wall clocks (``time.perf_counter_ns``); with CUDA also with CUDA events,
taking the larger of the two, so asynchronous kernels are counted. GPU metrics are omitted
(``None``) without a visible GPU or without ``nvidia-ml-py``.

Control port: rank 0 listens on ``port`` (HTTP). Any request, e.g. ``curl localhost:65535``,
asks to flip collection on/off; the flip takes effect at the next :meth:`report` on every
rank at once (rank 0 broadcasts the new state). Several requests between two reports amount
to one flip.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, HTTPServer
from types import TracebackType
from typing import Any, Literal

import torch
import torch.distributed as dist

from core_utils.distributed import collective_device, dist_ready

__all__ = ["StragglerData", "StragglerDetector", "ValueWithRank"]

logger = logging.getLogger(__name__)


class ValueWithRank:
    """A metric value together with the rank it was measured on and its unit.

    Args:
        value: The value (e.g. milliseconds).
        rank: The rank it belongs to.
        unit: Unit shown by ``str()``, e.g. ``"ms"``.
    """

    def __init__(self, value: float, rank: int, unit: str = "") -> None:
        self._value = value
        self._rank = rank
        self._unit = unit

    @property
    def value(self) -> float:
        """The value."""
        return self._value

    @property
    def rank(self) -> int:
        """The rank the value was measured on."""
        return self._rank

    @property
    def unit(self) -> str:
        """The unit of the value."""
        return self._unit

    def __lt__(self, other: ValueWithRank) -> bool:
        return self._value < other._value

    def __gt__(self, other: ValueWithRank) -> bool:
        return self._value > other._value

    def __call__(self) -> tuple[float, int, str]:
        """Return ``(value, rank, unit)``."""
        return self._value, self._rank, self._unit

    def __str__(self) -> str:
        return f"{self._value:.2f}{self._unit}/{self._rank}"

    def __repr__(self) -> str:
        return f"ValueWithRank(value={self._value!r}, rank={self._rank}, unit={self._unit!r})"


def _no_min(unit: str) -> ValueWithRank:
    return ValueWithRank(sys.float_info.max, 0, unit)


def _no_max(unit: str) -> ValueWithRank:
    return ValueWithRank(sys.float_info.min, 0, unit)


@dataclass
class StragglerData:
    """Minimum and maximum of each straggler metric across ranks, with the ranks holding them.

    Attributes:
        min_elapsed: Fastest average time per iteration of the timed region (ms).
        max_elapsed: Slowest average time per iteration (ms): the straggler.
        min_btime: Shortest data-loading time (ms, the longest single load per rank).
        max_btime: Longest data-loading time (ms).
        min_temp / max_temp: GPU temperature (C); ``None`` without GPU metrics.
        min_power / max_power: GPU power draw (W); ``None`` without GPU metrics.
        min_util / max_util: GPU utilisation (%); ``None`` without GPU metrics.
        min_clock / max_clock: GPU SM clock (MHz); ``None`` without GPU metrics.
        aflops: Estimated throughput (TFLOP/s) of every rank, sorted ascending.
    """

    min_elapsed: ValueWithRank = field(default_factory=lambda: _no_min("ms"))
    max_elapsed: ValueWithRank = field(default_factory=lambda: _no_max("ms"))
    min_btime: ValueWithRank = field(default_factory=lambda: _no_min("ms"))
    max_btime: ValueWithRank = field(default_factory=lambda: _no_max("ms"))
    min_temp: ValueWithRank | None = None
    max_temp: ValueWithRank | None = None
    min_power: ValueWithRank | None = None
    max_power: ValueWithRank | None = None
    min_util: ValueWithRank | None = None
    max_util: ValueWithRank | None = None
    min_clock: ValueWithRank | None = None
    max_clock: ValueWithRank | None = None
    aflops: list[ValueWithRank] | None = None


# The reference's (private) spellings of the two report types.
_ValueWithRank = ValueWithRank
_StragglerData = StragglerData

_GPU_METRICS = (("temp", "C"), ("power", "W"), ("util", "%"), ("clock", "MHz"))


def _gpu_metrics() -> dict[str, float | None]:
    """Temperature, power, utilisation and SM clock of the current GPU through NVML."""
    missing: dict[str, float | None] = {name: None for name, _ in _GPU_METRICS}
    if not torch.cuda.is_available():
        return missing
    try:
        import pynvml
    except ImportError:
        _warn_once("GPU metrics need nvidia-ml-py: pip install core-utils[nvml]")
        return missing
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return {
            "temp": float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)),
            "power": pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
            "util": float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
            "clock": float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
        }
    except Exception as exc:  # NVML errors vary by driver; metrics are best effort
        _warn_once(f"GPU metrics unavailable: {exc}")
        return missing


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


class _ControlHandler(BaseHTTPRequestHandler):
    detector: StragglerDetector

    def _toggle(self) -> None:
        state = self.detector._request_toggle()
        body = f"Will turn StragglerDetector {state} at next logging interval".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        logger.info(body.decode())

    do_GET = do_POST = do_PUT = do_HEAD = _toggle

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("straggler control: " + format, *args)


_METRIC_KEYS = ("rank", "time", "btime", "temp", "power", "util", "clock", "flops")


def _all_gather_metrics(mine: dict[str, Any]) -> list[dict[str, Any]]:
    """All-gather every rank's metric dict (numbers or None) as one float64 tensor.

    A tensor rather than ``all_gather_object``, which needs numpy (not a torch dependency).
    """
    if not dist_ready() or dist.get_world_size() == 1:
        return [dict(mine)]
    nan = float("nan")
    local = torch.tensor(
        [nan if mine[key] is None else float(mine[key]) for key in _METRIC_KEYS],
        dtype=torch.float64,
        device=collective_device(),
    )
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    rows = []
    for values in gathered:
        row: dict[str, Any] = {}
        for key, value in zip(_METRIC_KEYS, values.tolist(), strict=True):
            row[key] = None if value != value else value  # NaN marks "not measured"
        row["rank"] = int(row["rank"])
        rows.append(row)
    return rows


class StragglerDetector:
    """Per-process singleton timing a step region on every rank to find stragglers.

    ``StragglerDetector()`` always returns the same instance. It does nothing until
    :meth:`configure` is called with ``enabled=True`` (or collection is switched on
    through the control port): until then ``start``/``stop`` are no-ops.

    Attributes:
        last_report: The :class:`StragglerData` of the last :meth:`report` that measured
            something (on every rank), or ``None``.
        last_report_ranks: Per-rank raw data of that report: a list (index = rank) of dicts
            with ``time`` (ms per iteration), ``btime`` (ms), ``flops`` (TFLOP/s) and the GPU
            metrics (``None`` when unavailable).
    """

    _configured = False
    _instance: StragglerDetector | None = None

    def __new__(cls) -> StragglerDetector:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __init__(self) -> None:
        if getattr(self, "_initialised", False):
            return
        self._initialised = True
        self._lock = threading.Lock()
        self._off = True
        self.start = self.null_method
        self.stop = self.null_method
        self.world = 0
        self.rank = 0
        self.mmcnt = 1
        self.port = 0
        self.amp = 3.0
        self.toggle = False
        self.bdata = False
        self.dev: torch.device | None = None
        self.use_cuda_events = False
        self.evt_q: queue.LifoQueue[Any] | None = None
        self.start_gemm_ev: list[Any] = []
        self.stop_gemm_ev: list[Any] = []
        self.start_data_ev: list[Any] = []
        self.stop_data_ev: list[Any] = []
        self.start_gemm_tm: list[int] = []
        self.stop_gemm_tm: list[int] = []
        self.start_data_tm: list[int] = []
        self.stop_data_tm: list[int] = []
        self.server: HTTPServer | None = None
        self.ctrlr: threading.Thread | None = None
        self.last_report: StragglerData | None = None
        self.last_report_ranks: list[dict[str, Any]] | None = None

    def configure(
        self,
        world: int,
        rank: int,
        mmcnt: int = 1,
        amp: float = 3.0,
        port: int = 65535,
        prefill: int = 1024,
        enabled: bool = False,
    ) -> None:
        """Configure the detector once per process (later calls are ignored until :meth:`close`).

        Args:
            world: World size (the default process group's, if one exists).
            rank: This process's global rank.
            mmcnt: How many slowest and fastest ranks to list in the report.
            amp: Divides the throughput estimate: 3.0 when only the forward pass is timed
                (backward costs about twice the forward).
            port: Rank 0's HTTP control port; 0 picks a free port (see :attr:`control_port`).
            prefill: CUDA events created up front (CUDA only).
            enabled: Collect from the start; otherwise wait for a toggle.

        Raises:
            ValueError: A bad argument, or ``world``/``rank`` differ from torch.distributed's.
        """
        if StragglerDetector._configured:
            logger.debug("StragglerDetector is already configured; ignoring configure()")
            return
        if world < 1:
            raise ValueError(f"StragglerDetector.configure: world must be >= 1, got {world}")
        if not 0 <= rank < world:
            raise ValueError(
                f"StragglerDetector.configure: rank must be in [0, {world}), got {rank}"
            )
        if mmcnt < 1:
            raise ValueError(f"StragglerDetector.configure: mmcnt must be >= 1, got {mmcnt}")
        if not amp > 0:
            raise ValueError(f"StragglerDetector.configure: amp must be > 0, got {amp}")
        if not 0 <= port <= 65535:
            raise ValueError(f"StragglerDetector.configure: port must be in 0..65535, got {port}")
        if prefill < 0:
            raise ValueError(f"StragglerDetector.configure: prefill must be >= 0, got {prefill}")
        if dist_ready() and (world, rank) != (dist.get_world_size(), dist.get_rank()):
            raise ValueError(
                f"StragglerDetector.configure(world={world}, rank={rank}) disagrees with "
                f"torch.distributed (world size {dist.get_world_size()}, rank "
                f"{dist.get_rank()}); pass dist.get_world_size() and dist.get_rank()"
            )
        self.world, self.rank, self.mmcnt, self.amp, self.port = world, rank, mmcnt, amp, port
        self.toggle = False
        self.bdata = False
        self.dev = collective_device()
        self.use_cuda_events = torch.cuda.is_available()
        self.evt_q = queue.LifoQueue()
        if self.use_cuda_events:
            for _ in range(prefill):
                self.evt_q.put(torch.cuda.Event(enable_timing=True))
        self._clear()
        self._set_off(not enabled)
        if rank == 0:
            self._controller()
        StragglerDetector._configured = True

    def close(self) -> None:
        """Stop the control server and return to the unconfigured, disabled state."""
        server, thread = self.server, self.ctrlr
        self.server, self.ctrlr = None, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=10)
        self._clear()
        self._set_off(True)
        self.last_report = None
        self.last_report_ranks = None
        StragglerDetector._configured = False

    def _set_off(self, off: bool) -> None:
        self._off = off
        self.start = self.null_method if off else self.start_method
        self.stop = self.null_method if off else self.stop_method

    def _clear(self) -> None:
        if self.evt_q is not None:
            for event in (
                *self.start_gemm_ev,
                *self.stop_gemm_ev,
                *self.start_data_ev,
                *self.stop_data_ev,
            ):
                self.evt_q.put(event)
        self.start_gemm_ev, self.stop_gemm_ev = [], []
        self.start_data_ev, self.stop_data_ev = [], []
        self.start_gemm_tm, self.stop_gemm_tm = [], []
        self.start_data_tm, self.stop_data_tm = [], []
        self.bdata = False

    def reset(self) -> None:
        """Drop the timings collected since the last report (no-op while disabled)."""
        if self._off:
            return
        self._clear()

    def _event(self) -> Any:
        if self.evt_q is not None and not self.evt_q.empty():
            return self.evt_q.get_nowait()
        return torch.cuda.Event(enable_timing=True)

    def start_method(self) -> None:
        """Start timing a region (the data-loading timer if called as ``stimer(bdata=True)``)."""
        data = self.bdata
        self.bdata = False
        starts_tm, stops_tm = (
            (self.start_data_tm, self.stop_data_tm)
            if data
            else (
                self.start_gemm_tm,
                self.stop_gemm_tm,
            )
        )
        starts_tm.append(time.perf_counter_ns())
        stops_tm.append(0)
        if self.use_cuda_events:
            start_ev, stop_ev = self._event(), self._event()
            (self.start_data_ev if data else self.start_gemm_ev).append(start_ev)
            (self.stop_data_ev if data else self.stop_gemm_ev).append(stop_ev)
            start_ev.record()

    def stop_method(self) -> None:
        """Stop the innermost running timer (data-loading first, as it nests inside)."""
        now = time.perf_counter_ns()
        if self.stop_data_tm and self.stop_data_tm[-1] == 0:
            self.stop_data_tm[-1] = now
            if self.use_cuda_events:
                self.stop_data_ev[-1].record()
            return
        if self.stop_gemm_tm and self.stop_gemm_tm[-1] == 0:
            self.stop_gemm_tm[-1] = now
            if self.use_cuda_events:
                self.stop_gemm_ev[-1].record()

    def elapsed(
        self,
    ) -> tuple[float, float, float | None, float | None, float | None, float | None]:
        """Return the metrics collected since the last reset, then reset.

        Returns:
            ``(delta, batch_delta, temp, power, util, clock)``: total milliseconds in the
            timed region, the longest single data load in milliseconds, and the GPU
            temperature (C), power (W), utilisation (%) and SM clock (MHz), each ``None``
            without a GPU or NVML. All zero while disabled.
        """
        if self._off:
            return 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
        delta, batch_delta = 0.0, 0.0
        gpu = _gpu_metrics()
        if self.use_cuda_events and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        for i, (start, stop) in enumerate(zip(self.start_gemm_tm, self.stop_gemm_tm, strict=True)):
            if stop == 0:
                logger.warning("StragglerDetector: a timed region was started but not stopped")
                continue
            interval = (stop - start) / 1e6
            if self.use_cuda_events:
                interval = max(interval, self.start_gemm_ev[i].elapsed_time(self.stop_gemm_ev[i]))
            delta += interval
        for i, (start, stop) in enumerate(zip(self.start_data_tm, self.stop_data_tm, strict=True)):
            if stop == 0:
                logger.warning(
                    "StragglerDetector: a data-loading region was started but not stopped"
                )
                continue
            interval = (stop - start) / 1e6
            if self.use_cuda_events:
                interval = max(interval, self.start_data_ev[i].elapsed_time(self.stop_data_ev[i]))
            # Loaders prefetch: the longest load, not the sum, shows a stalled rank.
            batch_delta = max(batch_delta, interval)
        self.reset()
        return delta, batch_delta, gpu["temp"], gpu["power"], gpu["util"], gpu["clock"]

    def report(self, total_flops: float = 0.0, log_interval: int = 0) -> bool:
        """Compare the ranks' metrics since the last report; rank 0 logs the extremes.

        A collective: every rank must call it. It also applies a pending toggle from the
        control port on all ranks.

        Args:
            total_flops: Floating-point operations of the whole job over the interval
                (used for the per-rank throughput estimate); must be > 0 to report.
            log_interval: Iterations in the interval; must be > 0 to report.

        Returns:
            True on rank 0 when a report was logged, else False. :attr:`last_report` is
            updated on every rank whenever metrics were compared.
        """
        reported = False
        if not self._off and total_flops > 0.0 and log_interval > 0:
            delta, btime, temp, power, util, clock = self.elapsed()
            ptime = delta / log_interval
            flops_per_iteration = total_flops / log_interval
            tflops = 0.0
            if ptime > 0:
                # per-iteration flops of this rank / (ms * 1e9) = TFLOP/s
                tflops = flops_per_iteration / (ptime * 1e9 * self.world) / self.amp
            data = self._min_max(ptime, btime, temp, power, util, clock, tflops)
            if data is not None and self.rank == 0:
                self._log(data)
                reported = True
        self._check_toggle()
        return reported

    def _log(self, data: StragglerData) -> None:
        now = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        parts = [f"[{now}]", f"MnRtt/Rnk: {data.min_elapsed}", f"MxRtt/Rnk: {data.max_elapsed}"]
        for label, low, high in (
            ("Pwr", data.min_power, data.max_power),
            ("Tmp", data.min_temp, data.max_temp),
            ("Utl", data.min_util, data.max_util),
            ("Clk", data.min_clock, data.max_clock),
        ):
            if low is not None and high is not None:
                parts += [f"Mn{label}/Rnk: {low}", f"Mx{label}/Rnk: {high}"]
        parts += [f"MnDRtt/Rnk: {data.min_btime}", f"MxDRtt/Rnk: {data.max_btime}"]
        if data.aflops:
            low_f, high_f = data.aflops[0], data.aflops[-1]
            parts += [
                f"MnEtpt/Rnk: {low_f.value:.2f}TF/{low_f.rank}",
                f"MxEtpt/Rnk: {high_f.value:.2f}TF/{high_f.rank}",
            ]
        logger.info(" | ".join(parts))
        if data.aflops and 1 < self.mmcnt < self.world:
            bottom = ", ".join(str(v) for v in data.aflops[: self.mmcnt])
            top = ", ".join(str(v) for v in data.aflops[-self.mmcnt :])
            logger.info("^^^^ Bottom %d Ranks with lowest  Etpt(TF): %s", self.mmcnt, bottom)
            logger.info("^^^^ Top    %d Ranks with highest Etpt(TF): %s", self.mmcnt, top)

    def _min_max(
        self,
        ptime: float,
        btime: float,
        temp: float | None,
        power: float | None,
        util: float | None,
        clock: float | None,
        flops: float,
    ) -> StragglerData | None:
        """All-gather every rank's metrics and return their minima/maxima with ranks.

        Returns ``None`` while disabled.
        """
        if self._off:
            return None
        mine: dict[str, Any] = {
            "rank": self.rank,
            "time": ptime,
            "btime": btime,
            "temp": temp,
            "power": power,
            "util": util,
            "clock": clock,
            "flops": flops,
        }
        everyone = _all_gather_metrics(mine)
        result = StragglerData()

        def extremes(key: str, unit: str) -> tuple[ValueWithRank, ValueWithRank] | None:
            rows = [row for row in everyone if row[key] is not None]
            if not rows:
                return None
            low = min(rows, key=lambda row: row[key])
            high = max(rows, key=lambda row: row[key])
            return (
                ValueWithRank(float(low[key]), int(low["rank"]), unit),
                ValueWithRank(float(high[key]), int(high["rank"]), unit),
            )

        elapsed = extremes("time", "ms")
        batch = extremes("btime", "ms")
        if elapsed is not None:
            result.min_elapsed, result.max_elapsed = elapsed
        if batch is not None:
            result.min_btime, result.max_btime = batch
        for key, unit in _GPU_METRICS:
            pair = extremes(key, unit)
            if pair is not None:
                setattr(result, f"min_{key}", pair[0])
                setattr(result, f"max_{key}", pair[1])
        result.aflops = sorted(
            (ValueWithRank(float(row["flops"]), int(row["rank"])) for row in everyone),
            key=lambda v: v.value,
        )
        self.last_report = result
        self.last_report_ranks = sorted(everyone, key=lambda row: row["rank"])
        return result

    def _request_toggle(self) -> str:
        """Record a toggle request (control thread); return the state it will switch to."""
        with self._lock:
            self.toggle = True
            return "ON" if self._off else "OFF"

    def _check_toggle(self) -> None:
        """Apply a pending toggle from rank 0's control port on every rank (collective)."""
        off = self._off
        if self.rank == 0:
            with self._lock:
                if self.toggle:
                    off = not off
                    self.toggle = False
        if dist_ready() and dist.get_world_size() > 1:
            state = torch.tensor([int(off)], dtype=torch.int32, device=collective_device())
            dist.broadcast(state, src=0)
            off = bool(state.item())
        if off != self._off:
            self._set_off(off)
            self._clear()
            if self.rank == 0:
                logger.info("Toggling StragglerDetector state %s", "OFF" if off else "ON")

    def _handler(self) -> None:
        """Serve control requests until :meth:`close` (runs in the controller thread)."""
        server = self.server
        if server is None:
            return
        logger.info(
            "StragglerDetector control listening on port %d; state %s",
            server.server_address[1],
            "OFF" if self._off else "ON",
        )
        server.serve_forever(poll_interval=0.2)

    def _controller(self) -> None:
        """Start rank 0's HTTP control server; a failure only disables remote control."""
        handler = type("_BoundControlHandler", (_ControlHandler,), {"detector": self})
        try:
            self.server = HTTPServer(("", self.port), handler)
        except OSError as exc:
            logger.warning(
                "StragglerDetector cannot listen on port %d (%s); remote toggling disabled",
                self.port,
                exc,
            )
            self.server = None
            return
        self.ctrlr = threading.Thread(target=self._handler, name="straggler-control", daemon=True)
        self.ctrlr.start()

    @property
    def control_port(self) -> int | None:
        """The port rank 0's control server listens on (``None`` elsewhere or if it failed)."""
        if self.server is None:
            return None
        return int(self.server.server_address[1])

    @property
    def enabled(self) -> bool:
        """Whether collection is on (a toggle takes effect at the next :meth:`report`)."""
        return not self._off

    @property
    def configured(self) -> bool:
        """Whether :meth:`configure` has been called (and not undone by :meth:`close`)."""
        return StragglerDetector._configured

    @property
    def my_rank(self) -> int:
        """The configured rank."""
        return self.rank

    @property
    def world_size(self) -> int:
        """The configured world size."""
        return self.world

    def null_method(self) -> None:
        """Do nothing (``start``/``stop`` while disabled)."""

    def __enter__(self) -> StragglerDetector:
        self.start()
        return self

    def __call__(self, bdata: bool = False) -> StragglerDetector:
        """Select the timer for the next ``with`` block: data loading if ``bdata``."""
        self.bdata = bdata
        return self

    def __exit__(
        self,
        ex_type: type[BaseException] | None,
        ex_val: BaseException | None,
        ex_tb: TracebackType | None,
    ) -> Literal[False]:
        """Stop the region; an exception raised in it is logged and then propagates.

        Returns:
            False always: the exception is never swallowed (as in megatron-core 0.19.2's
            code, whose docstring says it returns True when the exception was handled).
        """
        if ex_type is not None:
            logger.warning(
                "exception in a StragglerDetector region: %s\n%s",
                ex_val,
                "".join(traceback.format_exception(ex_type, ex_val, ex_tb)),
            )
        self.stop()
        return False
