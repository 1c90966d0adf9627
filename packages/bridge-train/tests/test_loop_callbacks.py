"""The loop of components and users' callbacks.

Without processes: the driver (``run_loop``) with a scripted step (hook order, the state a
callback sees, stop requests, the rerun state machine's stop, a failing callback named) and
the ``Checkpointer``'s decisions with a recording save function. With one forked rank: a
real ``pretrain`` run with a recording callback and the documented example callback
(docs/training.md, executed from the page); ``bridge-train``'s ``main`` with callbacks from
YAML (``_target_``), one of which raises (exit code 1, one line).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from bridge.config import (
    CheckpointConfig,
    ConfigContainer,
    LoggerConfig,
    TrainingConfig,
)
from bridge.resiliency import ExitConditions
from bridge.train import (
    Callback,
    CallbackError,
    GlobalState,
    LoopContext,
    StepResult,
    pretrain,
)
from bridge.train.cli import EXIT_CALLBACK_ERROR, EXIT_CONFIG_ERROR, main
from bridge.train.loop.components import Checkpointer
from bridge.train.metrics import read_metrics_file
from bridge.train.recipes import DEFAULT_RECIPE, recipe_path
from bridge.train.testing import tiny_config_container, tiny_train_config
from core_utils import CallbackList
from core_utils.loop import run_loop
from core_utils.testing import run_distributed

DOCS = Path(__file__).resolve().parents[3] / "docs"


class Recorder(Callback):
    """Records every hook with the iteration and, after a step, its host loss."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, float | None]] = []

    def _add(self, hook: str, context: LoopContext) -> None:
        result = context.step_result
        loss = None
        if hook == "on_step_end" and result is not None and "lm loss" in result.losses:
            loss = float(result.losses["lm loss"])
        self.events.append((hook, context.iteration, loss))

    def on_train_start(self, context: LoopContext) -> None:
        self._add("on_train_start", context)

    def on_step_start(self, context: LoopContext) -> None:
        self._add("on_step_start", context)

    def on_step_end(self, context: LoopContext) -> None:
        self._add("on_step_end", context)

    def on_validation_start(self, context: LoopContext) -> None:
        self._add("on_validation_start", context)

    def on_validation_end(self, context: LoopContext) -> None:
        self._add("on_validation_end", context)

    def on_save(self, context: LoopContext) -> None:
        self._add("on_save", context)

    def on_train_end(self, context: LoopContext) -> None:
        self._add("on_train_end", context)


def _hooks(events: list[tuple[str, int, Any]]) -> list[str]:
    return [f"{hook}@{iteration}" for hook, iteration, _ in events]


# --------------------------------------------------------------------------- the driver


def _scripted_step(losses: list[float], exit_at: int | None = None) -> Any:
    def step(context: LoopContext) -> StepResult:
        if exit_at is not None and context.iteration == exit_at:
            return StepResult(skipped=True, should_exit=True, exit_code=17)
        value = torch.tensor(losses[context.iteration], dtype=torch.float64)
        return StepResult(losses={"lm loss": value}, num_samples=4, flops=10.0)

    return step


def _context(*callbacks: Callback, components: tuple[Callback, ...] = ()) -> LoopContext:
    state = GlobalState()
    context = LoopContext(state.train_state, [], None, None, state=state)
    context.callbacks = CallbackList(components, callbacks)
    return context


def _done_after(n: int) -> Any:
    return lambda context: context.iteration >= n


def test_driver_order_state_and_stop_requests() -> None:
    class Component(Callback):
        def on_step_end(self, context: LoopContext) -> None:
            recorder.events.append(("component", context.iteration, None))

    class StopAtTwo(Callback):
        def on_step_end(self, context: LoopContext) -> None:
            if context.iteration == 2:
                context.request_stop("enough", exit_code=3)

    recorder = Recorder()
    context = _context(recorder, StopAtTwo(), components=(Component(),))
    code = run_loop(context, _scripted_step([0.5, 0.25, 0.125]), _done_after(10))
    assert code == 3 and context.stop_reason == "enough"
    assert [(h, i, loss) for h, i, loss in recorder.events] == [
        ("on_train_start", 0, None),
        ("on_step_start", 0, None),
        ("component", 1, None),  # components run before the user's callbacks
        ("on_step_end", 1, 0.5),  # the iteration is already advanced at step end
        ("on_step_start", 1, None),
        ("component", 2, None),
        ("on_step_end", 2, 0.25),
        ("on_train_end", 2, None),
    ]
    train_state = context.state.train_state
    assert train_state.step == 2 and train_state.consumed_train_samples == 8
    assert train_state.floating_point_operations_so_far == 20.0
    assert context.step_flops == 10.0


def test_rerun_stop_does_not_advance_and_keeps_its_exit_code() -> None:
    recorder = Recorder()
    context = _context(recorder)
    code = run_loop(context, _scripted_step([1.0, 1.0], exit_at=1), _done_after(10))
    assert code == 17 and context.iteration == 1
    assert _hooks(recorder.events)[-3:] == ["on_step_start@1", "on_step_end@1", "on_train_end@1"]
    assert context.step_result is not None and not context.step_result.completed
    # A later request cannot turn the failure into success; a failure replaces success.
    context.request_stop("other", exit_code=0)
    assert context.exit_code == 17
    assert context.stop_reason is not None and context.stop_reason.startswith("the rerun")


def test_a_failing_callback_is_named_with_hook_and_iteration() -> None:
    class Broken(Callback):
        def on_step_end(self, context: LoopContext) -> None:
            if context.iteration == 2:
                raise ValueError("bad value")

    context = _context(Broken())
    with pytest.raises(CallbackError) as info:
        run_loop(context, _scripted_step([1.0, 1.0, 1.0]), _done_after(10))
    assert str(info.value) == (
        "callback test_a_failing_callback_is_named_with_hook_and_iteration.<locals>.Broken"
        ".on_step_end raised at iteration 2: ValueError: bad value"
    )
    assert isinstance(info.value.__cause__, ValueError)


# --------------------------------------------------------------------------- the checkpointer


def test_checkpointer_owns_every_save_decision() -> None:
    saves: list[tuple[int, bool]] = []
    recorder = Recorder()

    def save(context: LoopContext, non_persistent: bool) -> None:
        saves.append((context.iteration, non_persistent))

    cfg = CheckpointConfig(
        save="/unused",
        save_interval=4,
        non_persistent_save_interval=3,
        non_persistent_ckpt_type="global",
    )
    exits = ExitConditions.from_config(
        TrainingConfig(train_iters=20, exit_interval=7), save_enabled=True
    )
    try:
        checkpointer = Checkpointer(save, cfg, exit_conditions=exits)
        context = _context(recorder, components=(checkpointer,))
        code = run_loop(context, _scripted_step([1.0] * 20), _done_after(20))
    finally:
        exits.close()
    assert code == 0 and context.stop_reason is not None and "7" in context.stop_reason
    # 3 non-persistent, 4 persistent, 6 non-persistent, 7: the exit interval saves once.
    assert saves == [(3, True), (4, False), (6, True), (7, False)]
    assert checkpointer.last_saved_iteration == 7
    assert [i for h, i, _ in recorder.events if h == "on_save"] == [3, 4, 6, 7]

    # The end of a run saves its last iteration unless just saved; async saves fire on_save
    # when they are committed, all of them at the end.
    saves.clear()
    pending: list[int] = []
    recorder = Recorder()

    def queue(context: LoopContext, non_persistent: bool) -> None:
        saves.append((context.iteration, non_persistent))
        pending.append(context.iteration)

    def finalize(context: LoopContext, blocking: bool) -> int:
        done = len(pending) if blocking else max(len(pending) - 1, 0)
        del pending[:done]
        return done

    checkpointer = Checkpointer(
        queue, CheckpointConfig(save="/unused", save_interval=2), None, finalize
    )
    context = _context(recorder, components=(checkpointer,))
    run_loop(context, _scripted_step([1.0] * 5), _done_after(5))
    assert saves == [(2, False), (4, False), (5, False)]
    # The save of 2 commits after step 5 (this finalizer keeps the newest save pending
    # until the end); the saves of 4 and 5 commit at the end.
    assert [i for h, i, _ in recorder.events if h == "on_save"] == [5, 5, 5]
    assert pending == []


# --------------------------------------------------------------------------- pretrain


def _doc_example() -> dict[str, Any]:
    """The Python block of docs/training.md's "Callbacks" section, executed (not as main)."""
    text = (DOCS / "training.md").read_text()
    section = text[text.index("### Callbacks") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    namespace: dict[str, Any] = {"__name__": "loss_history"}
    exec(compile(code.group(1), "docs/training.md", "exec"), namespace)
    return namespace


def _callbacks_run(rank: int, world: int, tmp: str) -> dict[str, Any]:
    recorder = Recorder()
    history = _doc_example()["LossHistory"](every=2)
    cfg = tiny_config_container(
        train=tiny_train_config(train_iters=4, eval_interval=2, eval_iters=1),
        checkpoint=CheckpointConfig(save=f"{tmp}/ckpt", save_interval=2),
        logger=LoggerConfig(log_interval=2),
    )
    code = pretrain(cfg, metrics_file=f"{tmp}/metrics.jsonl", callbacks=[recorder, history])
    return {
        "code": code,
        "events": recorder.events,
        "losses": history.losses,
        "saves": history.saves,
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_pretrain_fires_every_hook_in_order_with_the_step_result(tmp_path: Path) -> None:
    (out,) = run_distributed(_callbacks_run, 1, str(tmp_path), timeout=150)
    assert out["code"] == 0
    assert _hooks(out["events"]) == [
        "on_train_start@0",
        "on_step_start@0",
        "on_step_end@1",
        "on_step_start@1",
        "on_step_end@2",
        "on_validation_start@2",
        "on_validation_end@2",
        "on_save@2",
        "on_step_start@2",
        "on_step_end@3",
        "on_step_start@3",
        "on_step_end@4",
        "on_validation_start@4",
        "on_validation_end@4",
        "on_save@4",
        "on_train_end@4",
    ]
    # The losses a callback reads are the ones the metric writers logged.
    logged = {
        r["step"]: r["lm loss"]
        for r in read_metrics_file(tmp_path / "metrics.jsonl")
        if "lm loss" in r
    }
    seen = {i: loss for hook, i, loss in out["events"] if hook == "on_step_end"}
    assert seen == pytest.approx(logged, rel=1e-6) and sorted(seen) == [1, 2, 3, 4]
    # The documented example callback ran alongside.
    assert out["losses"] == {2: seen[2], 4: seen[4]}
    assert out["saves"] == [2, 4]


def test_pretrain_refuses_a_non_callback_before_starting() -> None:
    with pytest.raises(TypeError, match=r"not a core_utils\.Callback"):
        pretrain(tiny_config_container(), callbacks=[object()])  # type: ignore[list-item]


# --------------------------------------------------------------------------- bridge-train + YAML

_CALLBACK_MODULE = """
import json
from dataclasses import dataclass

from bridge.train import Callback


@dataclass
class HookLog(Callback):
    path: str
    every: int = 1

    def on_step_end(self, context):
        if context.iteration % self.every == 0:
            with open(self.path, "a") as handle:
                handle.write(json.dumps([context.iteration, float(context.step_result.losses["lm loss"])]) + "\\n")


class Explodes(Callback):
    def on_step_end(self, context):
        if context.iteration == 3:
            raise ValueError("exploded on purpose")
"""


def _recipe_with_callbacks(tmp_path: Path, callbacks: list[dict[str, Any]]) -> Path:
    recipe = yaml.safe_load(recipe_path(DEFAULT_RECIPE).read_text())
    recipe["callbacks"] = callbacks
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _cli_run(rank: int, world: int, argv: list[str], path: str) -> Any:
    sys.path.insert(0, path)
    try:
        main(argv)
    except SystemExit as exit_:
        return exit_.code
    return None


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_bridge_train_runs_yaml_callbacks_and_names_a_failing_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "my_callbacks.py").write_text(_CALLBACK_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    log = tmp_path / "hooks.jsonl"
    recipe = _recipe_with_callbacks(
        tmp_path,
        [
            {"_target_": "my_callbacks.HookLog", "path": str(log)},
            {"_target_": "my_callbacks.Explodes"},
        ],
    )
    save = tmp_path / "run"
    argv = ["--config", str(recipe), "--no-print-config", "train.train_iters=6"]
    (code,) = run_distributed(
        _cli_run, 1, [*argv, f"checkpoint.save={save}"], str(tmp_path), timeout=150
    )
    err = capfd.readouterr().err
    assert code == EXIT_CALLBACK_ERROR, err[-3000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        "bridge-train: error: callback Explodes.on_step_end raised at iteration 3: "
        "ValueError: exploded on purpose"
    )
    # The first callback ran before it (in the listed order), every step until the failure.
    assert [json.loads(line)[0] for line in log.read_text().splitlines()] == [1, 2, 3]
    # run_config.yaml holds the callbacks and loads back as the same run.
    saved = ConfigContainer.from_yaml(save / "run_config.yaml")
    assert [type(c).__name__ for c in saved.callbacks] == ["HookLog", "Explodes"]
    assert saved.callbacks[0].path == str(log)

    # A bad _target_ is a configuration error naming the entry, before anything runs.
    recipe = _recipe_with_callbacks(
        tmp_path,
        [{"_target_": "my_callbacks.HookLog", "path": "x"}, {"_target_": "json.JSONDecoder"}],
    )
    with pytest.raises(SystemExit) as info:
        main(["--config", str(recipe), "--no-print-config"])
    assert info.value.code == EXIT_CONFIG_ERROR
    assert (
        capfd.readouterr()
        .err.strip()
        .splitlines()[-1]
        .startswith(
            "bridge-train: error: callbacks[1]: got JSONDecoder, which is not a training-loop "
            "callback"
        )
    )
