"""Which saved optimizer states convert into this run's, and how their keys are matched.

One process, no training: the rules of ``load._check_reshardable`` on checkpoint metadata,
and :mod:`bridge.train.checkpointing.optimizer_conversion` on sharded tensors. The
conversions themselves are exercised end to end (saved, resumed under another layout,
compared with the uninterrupted run) by ``tests/test_megatron_engine_layouts.py`` and
``tests/test_megatron_checkpoints.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from bridge.train.checkpointing import CheckpointError
from bridge.train.checkpointing.load import _check_reshardable
from bridge.train.checkpointing.optimizer_conversion import (
    conversion_template,
    converted_optimizer_state,
)
from bridge.train.checkpointing.optimizer_load import checkpoint_group_bounds

# megatron's optimizer kinds, as optimizer_format tells them apart (by class name).
DistributedOptimizer = type("DistributedOptimizer", (), {})
FP32Optimizer = type("FP32Optimizer", (), {})


class _Chained:
    def __init__(self, *parts: Any) -> None:
        self.chained_optimizers = list(parts)


def _meta(fmt: str, parts: int = 1, **layout: int) -> dict[str, Any]:
    return {
        "parallel_layout": {
            "world_size": 2,
            "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 1,
            "context_parallel_size": 1,
            "data_parallel_size": 2,
            **layout,
        },
        "model_chunks": 1,
        "optimizer_format": fmt,
        "optimizer_parts": parts,
    }


_THIS = {
    "world_size": 2,
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "context_parallel_size": 1,
    "data_parallel_size": 2,
}


@pytest.mark.parametrize(
    ("saved", "optimizer", "convert"),
    [
        (_meta("megatron"), _Chained(FP32Optimizer()), False),
        (_meta("megatron"), _Chained(DistributedOptimizer()), True),
        (_meta("distributed:fully_reshardable"), _Chained(FP32Optimizer()), True),
        (_meta("distributed:fully_reshardable", 2), _Chained(DistributedOptimizer()), True),
        (_meta("megatron", 1), _Chained(FP32Optimizer(), FP32Optimizer()), True),
        (_meta("distributed:dp_reshardable"), _Chained(DistributedOptimizer()), False),
        # The retired portable engine: per-parameter state with megatron's keys.
        (_meta("portable"), _Chained(FP32Optimizer()), True),
        (_meta("portable"), _Chained(DistributedOptimizer()), True),
    ],
)
def test_what_converts(saved: dict[str, Any], optimizer: Any, convert: bool) -> None:
    """Another format or number of parts converts; the same is loaded as it is."""
    assert _check_reshardable("ckpt", saved, _THIS, 1, optimizer) is convert


@pytest.mark.parametrize(
    ("saved", "optimizer", "reason"),
    [
        (
            _meta("distributed:dp_reshardable"),
            _Chained(FP32Optimizer()),
            "converts neither to per-parameter state",
        ),
        (
            _meta("distributed:dp_reshardable", 2),
            _Chained(DistributedOptimizer()),
            "nor to another number of optimizer parts",
        ),
        (
            _meta("distributed:dp_reshardable", tensor_model_parallel_size=2),
            _Chained(DistributedOptimizer()),
            "reshards across data-parallel sizes only",
        ),
    ],
)
def test_what_is_refused_names_both_layouts(
    saved: dict[str, Any], optimizer: Any, reason: str
) -> None:
    with pytest.raises(CheckpointError) as raised:
        _check_reshardable("ckpt", saved, _THIS, 1, optimizer)
    message = str(raised.value)
    assert message.startswith("ckpt was saved as TP")
    assert "this run is TP1 PP1 CP1 DP2" in message
    assert reason in message
    assert "checkpoint.load_optim=False" in message


def _tensor(key: str) -> ShardedTensor:
    return ShardedTensor.from_rank_offsets(key, torch.zeros(2, 3))


def test_main_parameters_are_found_under_either_spelling() -> None:
    """The distributed optimizer's ``param`` loads from a per-parameter checkpoint's
    ``fp32_param`` (and back); moments keep their key; an fp32 model's checkpoint has no
    main parameters, which then come from the model."""
    template = {
        "param_state": {
            0: {
                "param": _tensor("optimizer.state.param.w"),
                "exp_avg": _tensor("optimizer.state.exp_avg.w"),
            },
            1: {
                "param": _tensor("optimizer.state.param.b"),
                "exp_avg": _tensor("optimizer.state.exp_avg.b"),
            },
        }
    }
    saved = {
        "optimizer.state.fp32_param.w",
        "optimizer.state.exp_avg.w",
        "optimizer.state.exp_avg.b",
    }
    conversion = conversion_template(template, saved)
    assert [t.key for t in conversion.to_load.values()] == [
        "optimizer.state.fp32_param.w",
        "optimizer.state.exp_avg.w",
        "optimizer.state.exp_avg.b",
    ]
    assert conversion.main_params_from_model  # "b" has none


def test_the_saved_step_must_be_one() -> None:
    optimizer = _Chained(FP32Optimizer())
    template = {"state": {0: {"exp_avg": _tensor("optimizer.state.exp_avg.w")}}}
    conversion = conversion_template(template, {"optimizer.state.exp_avg.w"})
    saved_common = {
        0: {"state": {"common_step": torch.tensor(5.0)}},
        1: {"state": {"common_step": torch.tensor(4.0)}},
    }
    with pytest.raises(CheckpointError, match=r"differing steps \[4.0, 5.0\]"):
        converted_optimizer_state(
            optimizer, conversion, {0: torch.ones(2, 3)}, saved_common, "ckpt"
        )
    conversion = conversion_template(
        {"state": {0: {"exp_avg": _tensor("optimizer.state.exp_avg.w")}}},
        {"optimizer.state.exp_avg.w"},
    )
    state = converted_optimizer_state(
        optimizer,
        conversion,
        {0: torch.ones(2, 3)},
        {"optimizer": {"param_groups": [{"step": 5}, {"step": 5}]}},
        "ckpt",
    )
    assert torch.equal(state["state"][0]["exp_avg"], torch.ones(2, 3))
    assert float(state["state"]["common_step"]) == 5.0


def test_checkpoint_bounds_pair_groups_across_expert_parallelism() -> None:
    """With scheduler.use_checkpoint_opt_param_scheduler the saved bounds are found for each
    of this run's groups by weight-decay and learning-rate multipliers, whether or not the
    expert parameters were optimised apart; ambiguous bounds are refused."""

    def group(wd_mult: float, lr: float, expert: bool = False) -> dict[str, Any]:
        return {
            "wd_mult": wd_mult,
            "lr_mult": 1.0,
            "is_expert_parallel": expert,
            "max_lr": lr,
            "min_lr": lr / 10,
        }

    one_part = FP32Optimizer()
    one_part.param_groups = [group(1.0, 5e-4), group(0.0, 5e-4)]
    saved_two_parts = {
        0: {"param_groups": [group(1.0, 1e-3), group(0.0, 1e-3)]},
        1: {"param_groups": [group(1.0, 1e-3, expert=True)]},
    }
    bounds = checkpoint_group_bounds(_Chained(one_part), saved_two_parts, "ckpt")
    assert [b for _, _, b in bounds] == [{"max_lr": 1e-3, "min_lr": 1e-4}] * 2
    saved_two_parts[1]["param_groups"][0]["max_lr"] = 2e-3
    with pytest.raises(CheckpointError, match="use_checkpoint_opt_param_scheduler"):
        checkpoint_group_bounds(_Chained(one_part), saved_two_parts, "ckpt")
