"""The fault drills' trainer: a tiny distributed run wired to every bridge.resiliency hook.

A test helper of bridge-resiliency (not part of the shipped package). It is the reference
integration of the package (the order of calls a trainer makes) and a fault-injection drill
that runs under a launcher to check a setup end to end::

    uv run torchrun --nproc-per-node=2 --max-restarts=2 \\
        packages/bridge-resiliency/tests/resiliency_drill.py \\
        --save-dir /tmp/drill --train-iters 100 --fault-plan rank_killed,rank_hung \\
        --hang-timeout step:10,setup:60,checkpointing:60

    ft_launcher --nproc-per-node=2 --max-restarts=2 --ft-enable-nic-monitor=false \\
        --ft-rank-section-timeouts=setup:60,step:10,checkpointing:60 \\
        --ft-rank-out-of-section-timeout=10 packages/bridge-resiliency/tests/resiliency_drill.py \\
        --save-dir /tmp/drill --enable-ft-package --calc-ft-timeouts --fault-plan rank_hung

The loop is the stack's one training loop, :func:`core_utils.loop.run_loop`, as
bridge-train's: a tiny step function, and as components the resiliency objects of
:class:`bridge.resiliency.RunResiliency` in :mod:`bridge.resiliency.loop_components`
(fault-tolerance heartbeats, straggler reports, NVRx straggler polls, the same objects
bridge-train's loop runs) followed by the drill's recorder and checkpointer.
The model is a two-layer MLP trained with Adam on data that depends only on the iteration
and the rank, with gradients averaged by an all-reduce (what DDP does), so a run that is
interrupted and resumed reaches the same weights and losses bit for bit as one that was not.
Checkpoints are :class:`StepCheckpointer` directories with an atomically written tracker.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, cast

import torch
import torch.distributed as dist

from bridge.config import (
    FaultToleranceConfig,
    NVRxStragglerDetectionConfig,
    StragglerDetectionConfig,
    TrainingConfig,
)
from bridge.config.atomic_files import atomic_write, fsync_directory
from bridge.resiliency import (
    ExitConditions,
    ExitDecision,
    FaultTolerance,
    FaultToleranceHeartbeat,
    NVRxStragglerMonitor,
    NVRxStragglerPoll,
    ResiliencyError,
    RunResiliency,
    StragglerReporter,
    StragglerTiming,
    WatchdogTimeouts,
    init_process_group,
    restart_count,
)
from core_utils.callbacks import Callback, CallbackList
from core_utils.distributed import dist_ready, global_rank, global_world_size
from core_utils.loop import LoopContext, StepResult, run_loop

__all__ = [
    "TRACKER_FILENAME",
    "LoadedCheckpoint",
    "StepCheckpointer",
    "TinyRunOptions",
    "TinyRunResult",
    "main",
    "read_events",
    "run_tiny_training",
]

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"


def _barrier() -> None:
    if dist_ready() and dist.get_world_size() > 1:
        dist.barrier()


def _from_rank_0(value: Any) -> Any:
    """``value`` as rank 0 has it, on every rank (a collective when several ranks run)."""
    if dist_ready() and dist.get_world_size() > 1:
        holder = [value]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]
    return value


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint read back by :meth:`StepCheckpointer.load`.

    Attributes:
        iteration: Iterations completed when it was saved.
        state: What was saved.
        path: Its directory.
    """

    iteration: int
    state: dict[str, Any]
    path: Path


class StepCheckpointer:
    """One directory per saved iteration plus a tracker file written last, atomically.

    Layout: ``<save_dir>/iter_0000010/state.pt`` and ``<save_dir>/latest_checkpointed_
    iteration.txt`` holding ``10``. Rank 0 writes the state to a temporary directory, fsyncs
    it, renames it into place, then replaces the tracker (write temp, fsync, rename). A crash
    at any point leaves the tracker pointing at the previous complete checkpoint, even a
    crash after the rename (the directory is then complete but not named by the tracker: it
    is never loaded, and the next save of that iteration replaces it). Saving
    and loading are collectives (barriers) when torch.distributed is initialised; the state
    must be identical on every rank (data parallel).

    Args:
        save_dir: Directory of the checkpoints.
        rank: Global rank (default: torch.distributed's, else ``$RANK``).
        on_commit: Called on rank 0 with the iteration right after the tracker names it.
    """

    def __init__(
        self,
        save_dir: str | os.PathLike[str],
        *,
        rank: int | None = None,
        on_commit: Callable[[int], None] | None = None,
    ) -> None:
        self.save_dir = Path(save_dir)
        self.rank = global_rank(launcher_fallback=True) if rank is None else rank
        self.on_commit = on_commit

    @property
    def tracker(self) -> Path:
        """The tracker file."""
        return self.save_dir / TRACKER_FILENAME

    def path_for(self, iteration: int) -> Path:
        """Directory of the checkpoint of ``iteration``."""
        return self.save_dir / f"iter_{iteration:07d}"

    def latest_iteration(self) -> int | None:
        """Iteration named by the tracker, or ``None`` when nothing was saved.

        Raises:
            ResiliencyError: The tracker exists but does not hold an iteration number.
        """
        try:
            text = self.tracker.read_text().strip()
        except FileNotFoundError:
            return None
        if not text.isdigit():
            raise ResiliencyError(
                f"checkpoint tracker {self.tracker} holds {text!r}, not an iteration number"
            )
        return int(text)

    def save(
        self,
        iteration: int,
        state: dict[str, Any],
        *,
        before_commit: Callable[[Path], None] | None = None,
        before_tracker: Callable[[Path], None] | None = None,
    ) -> bool:
        """Save ``state`` as the checkpoint of ``iteration`` (a collective).

        Args:
            iteration: Iterations completed.
            state: What to save (``torch.save``-able); identical on every rank.
            before_commit: Called on rank 0 with the temporary directory after the state
                is written and before it is renamed into place (tests interrupt here).
            before_tracker: Called on rank 0 with the checkpoint directory after it was
                renamed into place and before the tracker names it (tests interrupt here).

        Returns:
            False when the tracker already names ``iteration`` (nothing written), else True.
        """
        # Rank 0's view, read before it writes anything, decides for every rank: a rank that
        # read the tracker itself could arrive after rank 0 committed this very iteration,
        # return early and skip the closing barrier rank 0 waits in (a deadlock seen on a
        # loaded machine, where one rank lags a whole save behind the other).
        latest = _from_rank_0(self.latest_iteration() if self.rank == 0 else None)
        if latest == iteration:
            return False
        if self.rank == 0:
            self.save_dir.mkdir(parents=True, exist_ok=True)
            final = self.path_for(iteration)
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=self.save_dir))
            with open(tmp / "state.pt", "wb") as handle:
                torch.save(state, handle)
                handle.flush()
                os.fsync(handle.fileno())
            fsync_directory(tmp)
            if before_commit is not None:
                before_commit(tmp)
            if final.exists():
                # Left by a run that died between rename and tracker: never referenced by the
                # tracker, so it is not a checkpoint anyone loaded; replace it.
                stale = self.save_dir / f".{final.name}.stale-{os.getpid()}"
                final.rename(stale)
                _remove_tree(stale)
            tmp.rename(final)
            fsync_directory(self.save_dir)
            if before_tracker is not None:
                before_tracker(final)
            atomic_write(self.tracker, f"{iteration}\n")
            if self.on_commit is not None:
                self.on_commit(iteration)
        _barrier()
        return True

    def load(self) -> LoadedCheckpoint | None:
        """Load the checkpoint the tracker names (``None`` when there is none)."""
        _barrier()
        iteration = self.latest_iteration()
        if iteration is None:
            return None
        path = self.path_for(iteration)
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
        return LoadedCheckpoint(iteration=iteration, state=state, path=path)


def _remove_tree(path: Path) -> None:
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


@dataclass
class TinyRunOptions:
    """Settings of one run of the tiny loop (every field is also a command-line option)."""

    save_dir: str
    """Checkpoint directory (``checkpoint.save``)."""
    log_dir: str | None = None
    """Directory for ``events.jsonl`` (rank 0) and ``rank<r>.pid`` files (unset: none)."""
    train_iters: int = 40
    """Iterations to train in total."""
    save_interval: int = 10
    """Save every this many iterations (and at the end)."""
    log_interval: int = 5
    """Straggler report interval in iterations."""
    seed: int = 1234
    """Seed of the model initialisation and the data."""
    step_sleep: float = 0.0
    """Seconds each rank sleeps inside the timed part of each step."""
    slow_rank: int | None = None
    """A rank that sleeps ``slow_rank_sleep`` more per step (a straggler)."""
    slow_rank_sleep: float = 0.0
    """Extra seconds per step on ``slow_rank``."""
    exit_save_delay: float = 0.0
    """Seconds rank 0 pauses inside a save requested by an exit decision (before commit)."""
    kill_during_save_at: int | None = None
    """In the first attempt, rank 0 SIGKILLs itself in the middle of this iteration's save."""
    fault_plan: tuple[str, ...] = ()
    """Fault per launch attempt (``TORCHELASTIC_RESTART_COUNT``): a simulated fault
    (``rank_hung``, ``rank_killed``, ``random``), ``kill_mid_save`` (rank 0 SIGKILLs itself
    in the attempt's first save, state written, directory not yet renamed into place),
    ``kill_before_tracker`` (the same, after the rename and before the tracker names the
    checkpoint) or ``none``."""
    fault_rank: int = 1
    """``ft.simulated_fault_rank``."""
    fault_delay: int = 1
    """``ft.simulated_fault_base_delay`` in seconds."""
    enable_ft_package: bool = False
    """``ft.enable_ft_package`` (run under ``ft_launcher``)."""
    calc_ft_timeouts: bool = False
    """``ft.calc_ft_timeouts``."""
    hang_timeout: float | WatchdogTimeouts | None = None
    """Built-in hang watchdog timeouts: seconds per step, or per phase (on the command line
    ``step:4,setup:60,checkpointing:60``; see ``WatchdogTimeouts.parse``). Without
    ``enable_ft_package``."""
    exit_signal_handler: bool = False
    """``train.exit_signal_handler`` (SIGTERM)."""
    exit_interval: int | None = None
    """``train.exit_interval``."""
    exit_duration_in_mins: int | None = None
    """``train.exit_duration_in_mins``."""
    log_straggler: bool = False
    """``straggler.log_straggler``."""
    straggler_port: int = 65535
    """``straggler.straggler_ctrlr_port``."""
    nvrx_straggler_report_at: int | None = None
    """``nvrx_straggler.enabled`` with ``stop_if_detected``: after this iteration rank 0's
    monitor evaluates a straggler report in which the last rank scores 0.3 (so it asks the
    job to stop; every rank saves and exits 0). The report is built here: NVRx's detector
    that would produce it needs CUDA and CUPTI."""
    pg_timeout: float = 120.0
    """Process-group timeout in seconds when this loop initialises torch.distributed."""


@dataclass
class TinyRunResult:
    """What one rank's run did.

    Attributes:
        rank: Global rank.
        attempt: Launch attempt (``TORCHELASTIC_RESTART_COUNT``, 0 without a launcher).
        start_iteration: Iteration resumed from (0 for a fresh start).
        iteration: Iterations completed at the end.
        losses: Iteration -> this rank's loss (``float.hex``, exact).
        decision: The last exit decision.
        state: Final model parameters.
        slowest_ranks: Slowest rank of each straggler report.
        ft_monitor: The fault-tolerance monitor that ran.
        ft_timeouts: Its timeouts after setup.
    """

    rank: int
    attempt: int
    start_iteration: int
    iteration: int
    losses: dict[int, str] = field(default_factory=dict)
    decision: ExitDecision = field(default_factory=ExitDecision)
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    slowest_ranks: list[int] = field(default_factory=list)
    ft_monitor: str = "none"
    ft_timeouts: dict[str, Any] = field(default_factory=dict)


class _TinyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


class _TinyAdam:
    """Adam for the tiny model.

    ``torch.optim`` imports ``torch._dynamo`` on first use, which costs seconds per process;
    fault drills start processes again and again, so the tiny loop updates its few
    parameters itself. Same update rule as ``torch.optim.Adam`` (no weight decay).
    """

    def __init__(self, params: list[torch.nn.Parameter], lr: float = 1e-2) -> None:
        self.params = params
        self.lr, self.beta1, self.beta2, self.eps = lr, 0.9, 0.999, 1e-8
        self.step_count = 0
        self.exp_avg = [torch.zeros_like(p) for p in params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in params]

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        bias1 = 1 - self.beta1**self.step_count
        bias2 = 1 - self.beta2**self.step_count
        for param, avg, avg_sq in zip(self.params, self.exp_avg, self.exp_avg_sq, strict=True):
            assert param.grad is not None
            avg.mul_(self.beta1).add_(param.grad, alpha=1 - self.beta1)
            avg_sq.mul_(self.beta2).addcmul_(param.grad, param.grad, value=1 - self.beta2)
            denom = (avg_sq / bias2).sqrt_().add_(self.eps)
            param.addcdiv_(avg, denom, value=-self.lr / bias1)

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step_count,
            "exp_avg": [t.clone() for t in self.exp_avg],
            "exp_avg_sq": [t.clone() for t in self.exp_avg_sq],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_count = int(state["step"])
        for mine, saved in zip(self.exp_avg, state["exp_avg"], strict=True):
            mine.copy_(saved)
        for mine, saved in zip(self.exp_avg_sq, state["exp_avg_sq"], strict=True):
            mine.copy_(saved)


def _batch(seed: int, iteration: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + iteration * 1_009 + rank)
    x = torch.randn(8, 16, generator=generator)
    y = x[:, :1].sin() + 0.1 * torch.randn(8, 1, generator=generator)
    return x, y


class _EventLog:
    """Rank 0 appends one JSON object per line; readers use :func:`read_events`."""

    def __init__(self, log_dir: str | None, rank: int, attempt: int) -> None:
        self.path = None if log_dir is None or rank != 0 else Path(log_dir) / "events.jsonl"
        self.attempt = attempt

    def write(self, event: str, **data: Any) -> None:
        if self.path is None:
            return
        record = {"event": event, "attempt": self.attempt, "time": time.time(), **data}
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")


def read_events(log_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events rank 0 logged in ``log_dir`` (a partial last line is skipped)."""
    path = Path(log_dir) / "events.jsonl"
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def _kill_in_save(events: _EventLog, event: str, iteration: int, path: Path) -> None:
    events.write(event, iteration=iteration, path=str(path))
    os.kill(os.getpid(), signal.SIGKILL)


def _pause_in_save(events: _EventLog, iteration: int, delay: float, tmp: Path) -> None:
    events.write("exit_save_in_progress", iteration=iteration, tmp=str(tmp))
    time.sleep(delay)


_SIMULATED_FAULTS = ("rank_hung", "rank_killed", "random")
_FAULT_PLANS = (*_SIMULATED_FAULTS, "kill_mid_save", "kill_before_tracker", "none")


def _attempt_plan(options: TinyRunOptions, attempt: int) -> str:
    plan = options.fault_plan[attempt] if attempt < len(options.fault_plan) else "none"
    if plan not in _FAULT_PLANS:
        raise ResiliencyError(
            f"TinyRunOptions.fault_plan: got {plan!r} for attempt {attempt}; expected one of "
            f"{', '.join(_FAULT_PLANS)}"
        )
    return plan


def _fault_config(options: TinyRunOptions, plan: str) -> FaultToleranceConfig:
    simulate = plan in _SIMULATED_FAULTS
    fault_type = cast(Literal["rank_hung", "rank_killed", "random"], plan)
    return FaultToleranceConfig(
        enable_ft_package=options.enable_ft_package,
        calc_ft_timeouts=options.calc_ft_timeouts,
        simulate_fault=simulate,
        simulated_fault_type=fault_type if simulate else "random",
        simulated_fault_rank=options.fault_rank if simulate else None,
        simulated_fault_base_delay=options.fault_delay,
    )


@dataclass(frozen=True)
class _StragglerReport:
    """The fields of ``nvidia_resiliency_ext.straggler.Report`` that are evaluated."""

    gpu_relative_perf_scores: dict[int, float]
    gpu_individual_perf_scores: dict[int, float]
    rank_to_node: dict[int, str]


def _report_naming_last_rank(world: int) -> _StragglerReport:
    relative = {r: 1.0 for r in range(world)}
    relative[world - 1] = 0.3
    return _StragglerReport(
        gpu_relative_perf_scores=relative,
        gpu_individual_perf_scores={r: 1.0 for r in range(world)},
        rank_to_node={r: "localhost" for r in range(world)},
    )


@dataclass
class _DrillProgress:
    """The drill's counters (:class:`core_utils.loop.TrainProgress`)."""

    step: int = 0
    consumed_train_samples: int = 0
    skipped_train_samples: int = 0
    floating_point_operations_so_far: float = 0.0


class _DrillStep:
    """One iteration of the tiny model: the loop's step function.

    Straggler timing covers data loading and the forward (megatron's stimer): the backward's
    gradient all-reduce is where fast ranks wait for slow ones.
    """

    def __init__(
        self,
        options: TinyRunOptions,
        model: _TinyModel,
        optimizer: _TinyAdam,
        timing: StragglerTiming,
        rank: int,
        world: int,
    ) -> None:
        self.options, self.model, self.optimizer = options, model, optimizer
        self.timing, self.rank, self.world = timing, rank, world
        n_params = sum(p.numel() for p in model.parameters())
        self.flops = 6.0 * n_params * 8 * world

    def __call__(self, context: LoopContext) -> StepResult:
        options, model = self.options, self.model
        self.optimizer.zero_grad()
        with self.timing.data():
            x, y = _batch(options.seed, context.iteration, self.rank)
        with self.timing.step():
            loss = torch.nn.functional.mse_loss(model(x), y)
            pause = options.step_sleep
            if options.slow_rank == self.rank:
                pause += options.slow_rank_sleep
            if pause > 0:
                time.sleep(pause)
        loss.backward()
        if dist_ready() and self.world > 1:
            for param in model.parameters():
                assert param.grad is not None
                dist.all_reduce(param.grad)
                param.grad.div_(self.world)
        self.optimizer.step()
        return StepResult(
            losses={"loss": loss.detach()}, num_samples=8 * self.world, flops=self.flops
        )


class _DrillRecorder(Callback):
    """Records every step's loss (``float.hex``, exact) and event; at
    ``nvrx_straggler_report_at`` rank 0's NVRx monitor evaluates a report naming the last
    rank a straggler (NVRx's detector that would produce it needs CUDA and CUPTI)."""

    def __init__(
        self,
        result: TinyRunResult,
        events: _EventLog,
        options: TinyRunOptions,
        monitor: NVRxStragglerMonitor | None,
        rank: int,
        world: int,
    ) -> None:
        self.result, self.events, self.options = result, events, options
        self.monitor, self.rank, self.world = monitor, rank, world

    def on_step_end(self, context: LoopContext) -> None:
        step_result = context.step_result
        assert step_result is not None
        iteration = context.iteration
        loss = float(step_result.losses["loss"].item())
        self.result.losses[iteration] = loss.hex()
        self.events.write("step", iteration=iteration, loss=self.result.losses[iteration])
        if (
            self.rank == 0
            and self.monitor is not None
            and iteration == self.options.nvrx_straggler_report_at
        ):
            self.monitor.evaluate(_report_naming_last_rank(self.world))
            self.events.write("straggler_report", iteration=iteration)


class _DrillCheckpointer(Callback):
    """The drill's save decisions: every ``save_interval`` iterations and at the end (with
    the fault plan's kills inside saves), then the exit conditions (one more save when an
    exit needs it); an exit stops the loop."""

    def __init__(
        self,
        checkpointer: StepCheckpointer,
        state: Callable[[], dict[str, Any]],
        exits: ExitConditions,
        fault_tolerance: FaultTolerance,
        result: TinyRunResult,
        events: _EventLog,
        options: TinyRunOptions,
        plan: str,
        attempt: int,
        rank: int,
    ) -> None:
        self.checkpointer, self.state, self.exits = checkpointer, state, exits
        self.fault_tolerance, self.result, self.events = fault_tolerance, result, events
        self.options, self.plan, self.attempt, self.rank = options, plan, attempt, rank
        self.saves_this_attempt = 0

    def on_step_end(self, context: LoopContext) -> None:
        options, rank, events = self.options, self.rank, self.events
        iteration = context.iteration
        saved = False
        if iteration % options.save_interval == 0 or iteration == options.train_iters:
            before_commit: Callable[[Path], None] | None = None
            before_tracker: Callable[[Path], None] | None = None
            first_save = self.saves_this_attempt == 0
            if rank == 0 and (
                (self.plan == "kill_mid_save" and first_save)
                or (options.kill_during_save_at == iteration and self.attempt == 0)
            ):
                before_commit = functools.partial(
                    _kill_in_save, events, "killing_mid_save", iteration
                )
            elif rank == 0 and self.plan == "kill_before_tracker" and first_save:
                before_tracker = functools.partial(
                    _kill_in_save, events, "killing_before_tracker", iteration
                )
            with self.fault_tolerance.checkpointing():
                saved = self.checkpointer.save(
                    iteration,
                    self.state(),
                    before_commit=before_commit,
                    before_tracker=before_tracker,
                )
            self.saves_this_attempt += int(saved)
        decision = self.exits.check(iteration, saved_this_iteration=saved)
        if decision.should_save:
            slow_commit: Callable[[Path], None] | None = None
            if options.exit_save_delay > 0:
                slow_commit = functools.partial(
                    _pause_in_save, events, iteration, options.exit_save_delay
                )
            with self.fault_tolerance.checkpointing():
                self.checkpointer.save(iteration, self.state(), before_commit=slow_commit)
        self.result.decision = decision
        if decision.should_exit:
            events.write("exit", iteration=iteration, reason=decision.reason)
            context.request_stop(decision.message, decision.exit_code)


def run_tiny_training(options: TinyRunOptions) -> TinyRunResult:
    """Train the tiny model with every resiliency hook in place; resume if a checkpoint exists.

    Uses the default process group when one exists (one process otherwise). The order of
    the calls is the one a trainer follows (see docs/resiliency.md).

    Args:
        options: The run settings.

    Returns:
        This rank's result.
    """
    rank, world = global_rank(launcher_fallback=True), global_world_size(launcher_fallback=True)
    attempt = restart_count()
    events = _EventLog(options.log_dir, rank, attempt)
    if options.log_dir is not None:
        Path(options.log_dir).mkdir(parents=True, exist_ok=True)
        (Path(options.log_dir) / f"rank{rank}.pid").write_text(str(os.getpid()))

    plan = _attempt_plan(options, attempt)

    # 1. Build the resiliency objects from config sections (before the model).
    resiliency = RunResiliency.build(
        ft=_fault_config(options, plan),
        straggler=StragglerDetectionConfig(
            log_straggler=options.log_straggler, straggler_ctrlr_port=options.straggler_port
        ),
        nvrx_straggler=NVRxStragglerDetectionConfig(
            enabled=options.nvrx_straggler_report_at is not None, stop_if_detected=True
        ),
        train=TrainingConfig(
            train_iters=options.train_iters,
            exit_signal_handler=options.exit_signal_handler,
            exit_interval=options.exit_interval,
            exit_duration_in_mins=options.exit_duration_in_mins,
        ),
        checkpoint_dir=options.save_dir,
        hang_timeout=options.hang_timeout,
        rank=rank,
        world_size=world,
    )
    ft = resiliency.fault_tolerance
    exits = resiliency.exit_conditions
    assert exits is not None
    checkpointer = StepCheckpointer(
        options.save_dir,
        rank=rank,
        on_commit=lambda saved_at: events.write("saved", iteration=saved_at),
    )
    clean = False
    result = TinyRunResult(rank=rank, attempt=attempt, start_iteration=0, iteration=0)
    try:
        # 2. Setup: monitoring starts, the model is built and the checkpoint loaded.
        ft.on_setup_start()
        torch.manual_seed(options.seed)
        model = _TinyModel()
        optimizer = _TinyAdam(list(model.parameters()), lr=1e-2)
        loaded = checkpointer.load()
        progress = _DrillProgress()
        if loaded is not None:
            model.load_state_dict(loaded.state["model"])
            optimizer.load_state_dict(loaded.state["optimizer"])
            progress.step = loaded.iteration
        result.start_iteration = progress.step
        result.ft_monitor = ft.monitor
        result.ft_timeouts = ft.timeouts()
        events.write(
            "start",
            iteration=progress.step,
            world=world,
            ft_monitor=ft.monitor,
            ft_timeouts=result.ft_timeouts,
        )
        ft.on_setup_end(checkpoint_loaded=loaded is not None)

        def state() -> dict[str, Any]:
            return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

        # 3. The loop: the components bridge-train's loop runs, in its order, then the
        # drill's recorder and checkpointer.
        stragglers = StragglerReporter(resiliency.straggler_timing, options.log_interval)
        result.slowest_ranks = stragglers.slowest_ranks  # the reporter appends to it
        components: list[Callback] = [FaultToleranceHeartbeat(ft), stragglers]
        if resiliency.nvrx_straggler is not None:
            components.append(NVRxStragglerPoll(resiliency.nvrx_straggler))
        components += [
            _DrillRecorder(result, events, options, resiliency.nvrx_straggler, rank, world),
            _DrillCheckpointer(
                checkpointer, state, exits, ft, result, events, options, plan, attempt, rank
            ),
        ]
        context = LoopContext(
            progress, [model], optimizer, None, callbacks=CallbackList(components)
        )
        step = _DrillStep(options, model, optimizer, resiliency.straggler_timing, rank, world)
        run_loop(context, step, lambda c: c.iteration >= options.train_iters)
        result.iteration = context.iteration
        result.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        events.write("finished", iteration=context.iteration)
        clean = True
    finally:
        # 4. Teardown: computed timeouts are stored only after a clean finish.
        for _, action in resiliency.teardown_steps(clean):
            action()
    return result


def _hang_timeouts_argument(text: str) -> WatchdogTimeouts:
    try:
        return WatchdogTimeouts.parse(text)
    except ResiliencyError as exc:  # argparse reports only its own error types cleanly
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="resiliency_drill.py",
        description="Tiny distributed training loop for fault-tolerance drills.",
    )
    for f in dataclasses.fields(TinyRunOptions):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            parser.add_argument(flag, action="store_true", help=f"set {f.name}")
        elif f.name == "fault_plan":
            parser.add_argument(
                flag,
                default="",
                help=f"comma-separated fault per attempt: {', '.join(_FAULT_PLANS)}",
            )
        elif f.name == "hang_timeout":
            parser.add_argument(
                flag,
                type=_hang_timeouts_argument,
                default=None,
                help="seconds per step, or step:S,setup:S,checkpointing:S,out_of_section:S",
            )
        else:
            kind: Callable[[str], Any]
            kind = float if "float" in str(f.type) else int if "int" in str(f.type) else str
            required = f.default is dataclasses.MISSING
            parser.add_argument(
                flag,
                type=kind,
                required=required,
                default=None if required else f.default,
                help=f"{f.name}",
            )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the tiny loop under ``torchrun``/``ft_launcher`` (or alone); return the exit code."""
    args = vars(_parser().parse_args(argv))
    plan = args.pop("fault_plan")
    options = TinyRunOptions(**args, fault_plan=tuple(p for p in plan.split(",") if p))
    torch.set_num_threads(1)
    owns_group = False
    if not dist_ready() and "WORLD_SIZE" in os.environ:
        init_process_group("gloo", timeout=timedelta(seconds=options.pg_timeout))
        owns_group = True
    try:
        result = run_tiny_training(options)
    finally:
        if owns_group:
            dist.destroy_process_group()
    return result.decision.exit_code


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written and closed; skipping interpreter teardown (seconds with torch
    # loaded) makes every drill restart that much faster.
    os._exit(exit_code)
