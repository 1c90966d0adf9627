"""The reference's loop functions (``train``, ``train_step``, ``evaluate``,
``save_checkpoint_and_time``), each called on a state built by ``setup``.

One forked rank: ``train`` runs the run to its length with evaluation and a final save and
records both iterations in the state it was given; ``train_step`` returns the reference's
7-tuple; ``evaluate`` averages the validation loss and advances the validation counter;
``save_checkpoint_and_time`` writes the iteration's checkpoint and records it;
``compute_throughputs_and_append_to_progress_log`` appends its progress line;
``post_training_step_callbacks`` runs the upkeep due at an iteration;
``checkpoint_and_decide_exit`` saves and says why when an exit condition holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import math
from pathlib import Path
from typing import Any

import pytest

import bridge.train as bt
from bridge.config import CheckpointConfig, LoggerConfig
from bridge.resiliency import ExitConditions
from bridge.train.checks.preflight import check_config_before_launch
from bridge.train.testing import tiny_config_container, tiny_train_config
from core_utils.testing import run_distributed


def _adapters_run(rank: int, world: int, tmp: str) -> dict[str, Any]:
    cfg = tiny_config_container(
        train=tiny_train_config(train_iters=4, eval_interval=2, eval_iters=1),
        checkpoint=CheckpointConfig(save=f"{tmp}/ckpt", save_interval=100),
        logger=LoggerConfig(log_interval=2),
    )
    check_config_before_launch(cfg, world_size=1, cuda_available=False)
    state = bt.GlobalState(cfg=cfg)
    out = bt.setup(state)
    args = (out.model, out.optimizer, out.scheduler)
    code = bt.train(
        bt.forward_step,
        *args,
        out.train_data_iterator,
        out.valid_data_iterator,
        state,
        out.checkpointing_context,
    )
    result: dict[str, Any] = {
        "code": code,
        "step": state.train_state.step,
        "evaluated": state.last_evaluated_iteration,
        "saved": state.last_saved_iteration,
    }
    step = bt.train_step(bt.forward_step, out.train_data_iterator, *args, state)
    result["step_tuple"] = (len(step), float(step[0]["lm loss"]), step[1])
    valid_before = state.train_state.consumed_valid_samples
    losses, collected, _ = bt.evaluate(
        state, bt.forward_step, out.valid_data_iterator, out.model, None, cfg
    )
    result["eval"] = (float(losses["lm loss"]), collected)
    result["valid_advance"] = state.train_state.consumed_valid_samples - valid_before
    # The print-only form (the last rank prints; this run has one rank), with another
    # config's logger section: the perplexity switch of the config given is the one read.
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        test_losses = bt.evaluate_and_print_results(
            state,
            "iteration 4",
            bt.forward_step,
            out.valid_data_iterator,
            out.model,
            dataclasses.replace(cfg),
            write_to_tensorboard=False,
            split="test",
        )
    result["printed"] = (printed.getvalue(), float(test_losses["lm loss"]))
    state.train_state.step = 5  # as the loop would after the extra step
    state.timers("interval-time", log_level=0).start()  # paused by the save, as in the loop
    flops = state.train_state.floating_point_operations_so_far
    bt.save_checkpoint_and_time(state, *args, flops, out.checkpointing_context)
    result["saved_after"] = state.last_saved_iteration
    # The progress line of a saved checkpoint, written whether or not logger.log_progress is
    # on (this run has no 'Starting job' line: the launch counts as the earliest one).
    bt.compute_throughputs_and_append_to_progress_log(state, flops)
    # The per-step upkeep at an iteration on its intervals: the weight-hash check (one
    # replica: nothing differs) and a manual garbage collection.
    assert cfg.train is not None
    upkeep = dataclasses.replace(
        cfg,
        train=dataclasses.replace(
            cfg.train,
            check_weight_hash_across_dp_replicas_interval=5,
            manual_gc=True,
            manual_gc_interval=5,
        ),
    )
    collections: list[tuple[str, int]] = []  # gc.collect() is a full (generation 2) pass
    gc.callbacks.append(lambda phase, info: collections.append((phase, info["generation"])))
    try:
        bt.post_training_step_callbacks(
            out.model, flops, state.straggler_timing, 5, None, upkeep, False
        )
    finally:
        gc.callbacks.pop()
    result["collected"] = ("start", 2) in collections
    # An exit condition at iteration 6: the decision saves that iteration and says why.
    state.exit_conditions = ExitConditions(exit_interval=6)
    state.train_state.step = 6
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        result["exit"] = bt.checkpoint_and_decide_exit(
            state, *args, flops, out.checkpointing_context, out.train_data_iterator
        )
    result["exit_said"] = said.getvalue()
    result["saved_at_exit"] = state.last_saved_iteration
    return result


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_reference_loop_functions_on_a_setup_state(tmp_path: Path) -> None:
    (out,) = run_distributed(_adapters_run, 1, str(tmp_path), timeout=150)
    assert out["code"] == 0 and out["step"] == 4
    assert out["evaluated"] == 4 and out["saved"] == 4  # the final save of the run
    length, loss, skipped = out["step_tuple"]
    assert length == 7 and math.isfinite(loss) and skipped == 0
    eval_loss, collected = out["eval"]
    assert math.isfinite(eval_loss) and collected is None
    assert out["valid_advance"] == 4  # one global batch of the tiny config
    printed, test_loss = out["printed"]
    assert printed.startswith(" test loss at iteration 4 | lm loss value: ")
    assert f"lm loss PPL: {math.exp(test_loss):.6E} |" in printed
    assert out["saved_after"] == 5
    progress = (tmp_path / "ckpt" / "progress.txt").read_text().splitlines()
    assert (
        len(progress) == 1 and "\tSaved checkpoint\tIteration: 5\tJob throughput: " in progress[0]
    )
    assert out["collected"]
    assert out["exit"] is True and out["saved_at_exit"] == 6
    assert "[bridge-train] exiting after iteration 6: " in out["exit_said"]
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("iter_"))
    assert saved == ["iter_0000004", "iter_0000005", "iter_0000006"]
