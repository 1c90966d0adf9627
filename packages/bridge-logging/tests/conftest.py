"""Shared fixtures: a hand-made trainer state, readers for what the backends wrote."""

from __future__ import annotations

import json
import logging
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from bridge.config import ConfigContainer, LoggerConfig, TrainingConfig
from bridge.config.testing import tiny_container
from bridge.logging import MetricWriters
from core_utils import Timers


@dataclass
class Progress:
    """A TrainProgress (the shape of bridge-train's TrainState)."""

    step: int = 0
    consumed_train_samples: int = 0
    skipped_train_samples: int = 0
    consumed_valid_samples: int = 0
    floating_point_operations_so_far: float = 0.0


@dataclass
class RunState:
    """A LoggingState built by hand, as a trainer would."""

    cfg: ConfigContainer
    train_state: Progress
    timers: Timers
    metric_writers: MetricWriters
    start_time: float = field(default_factory=time.time)


def make_config(
    *,
    micro_batch_size: int = 2,
    global_batch_size: int = 4,
    train_iters: int = 6,
    world_size: int = 1,
    **logger: Any,
) -> ConfigContainer:
    """A validated container with the given logger switches."""
    cfg = tiny_container(
        train=TrainingConfig(
            micro_batch_size=micro_batch_size,
            global_batch_size=global_batch_size,
            train_iters=train_iters,
            eval_interval=None,
        ),
        logger=LoggerConfig(**logger),
    )
    cfg.validate(world_size=world_size)
    return cfg


def make_state(cfg: ConfigContainer, writers: MetricWriters) -> RunState:
    """A state whose timers follow cfg.logger and whose interval timer runs."""
    assert cfg.logger is not None
    timers = Timers(cfg.logger.timing_log_level, cfg.logger.timing_log_option)
    timers("interval-time", log_level=0).start()
    return RunState(cfg=cfg, train_state=Progress(), timers=timers, metric_writers=writers)


def read_tensorboard(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag in the event files of ``log_dir``: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    """History rows of an offline W&B run, decoded from its ``.wandb`` transaction log.

    The file is a LevelDB-style log: a 7-byte header (``:W&B``, magic, version), then
    32 KiB blocks of records, each with a 7-byte header (crc32, little-endian length,
    type: 1 full, 2 first, 3 middle, 4 last) followed by a serialised ``Record`` proto.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("run-*.wandb")
    raw = path.read_bytes()
    assert raw[:4] == b":W&B", raw[:7]
    block, pos, pending = 32768, 7, b""
    payloads: list[bytes] = []
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # block trailer too short for a header
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        data = raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            break
        if kind == 1:
            payloads.append(data)
        elif kind == 2:
            pending = data
        elif kind == 3:
            pending += data
        elif kind == 4:
            payloads.append(pending + data)
    rows = []
    for data in payloads:
        record = pb.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows


class TinyModel(torch.nn.Module):
    """Two linear layers, enough to produce real losses and gradients."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """Undo level, filter and handler changes made to Python's logging by a test."""
    root = logging.getLogger()
    loggers = [root] + [
        v for v in logging.root.manager.loggerDict.values() if isinstance(v, logging.Logger)
    ]
    saved = {id(lg): (lg, lg.level, list(lg.filters), list(lg.handlers)) for lg in loggers}
    handler_filters = {id(h): (h, list(h.filters)) for lg in loggers for h in lg.handlers}
    yield
    for lg, level, filters, handlers in saved.values():
        lg.setLevel(level)
        lg.filters[:] = filters
        lg.handlers[:] = handlers
    for h, filters in handler_filters.values():
        h.filters[:] = filters
    for entry in logging.root.manager.loggerDict.values():  # loggers and placeholders
        if isinstance(entry, logging.Logger) and id(entry) not in saved:
            entry.filters.clear()


class Kit:
    """The helpers above, reachable from test modules through the ``kit`` fixture
    (test modules cannot import conftest under ``--import-mode=importlib``)."""

    Progress = Progress
    RunState = RunState
    TinyModel = TinyModel
    make_config = staticmethod(make_config)
    make_state = staticmethod(make_state)
    read_tensorboard = staticmethod(read_tensorboard)
    read_wandb_history = staticmethod(read_wandb_history)


@pytest.fixture(scope="session")
def kit() -> type[Kit]:
    """Shared helpers: state dataclasses, config/state builders, backend readers."""
    return Kit
