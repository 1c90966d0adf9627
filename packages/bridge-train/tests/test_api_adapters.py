"""The reference's loop functions (``train``, ``train_step``, ``evaluate``,
``save_checkpoint_and_time``), each called on a state built by ``setup``.

One forked rank: ``train`` runs the run to its length with evaluation and a final save and
records both iterations in the state it was given; ``train_step`` returns the reference's
7-tuple; ``evaluate`` averages the validation loss and advances the validation counter;
``save_checkpoint_and_time`` writes the iteration's checkpoint and records it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
from pathlib import Path
from typing import Any

import pytest

import bridge.train as bt
from bridge.config import CheckpointConfig, LoggerConfig
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
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("iter_"))
    assert saved == ["iter_0000004", "iter_0000005"]
