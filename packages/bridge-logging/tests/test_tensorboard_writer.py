"""TensorBoard: the in-process writer's two ways of writing a step (one event, or
add_scalar per tag), and the writer process's event files in the default mode."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("tensorboard")

import torch.utils.tensorboard
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

from bridge.config import LoggerConfig
from bridge.logging import MetricWriter, MetricWriters, TensorBoardWriter, build_metric_writers


class _AccessorPrivateToTorch(torch.utils.tensorboard.SummaryWriter):
    """A real SummaryWriter whose ``_get_file_writer`` only torch's own code can see, as in
    a torch release that renamed it: callers outside torch get ``AttributeError``."""

    def __getattribute__(self, name: str) -> Any:
        if name == "_get_file_writer":
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if not caller.startswith("torch."):
                raise AttributeError(name)
        return super().__getattribute__(name)


def _events(where: Path) -> list[tuple[int, list[tuple[str, float]]]]:
    """``(step, [(tag, value), ...])`` of every summary event of an event file, or of the
    event files of a directory, in file order."""
    events = []
    paths = [where] if where.is_file() else sorted(where.glob("events.out.tfevents.*"))
    for path in paths:
        for event in LegacyEventFileLoader(str(path)).Load():
            if event.HasField("summary"):
                values = [(v.tag, v.simple_value) for v in event.summary.value]
                events.append((event.step, values))
    return events


@pytest.mark.parametrize("accessor", ["present", "missing"])
def test_a_step_is_one_event_or_one_add_scalar_per_tag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, accessor: str
) -> None:
    if accessor == "missing":
        monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", _AccessorPrivateToTorch)
    writer = TensorBoardWriter(tmp_path)
    if accessor == "missing":
        assert isinstance(writer.backend, _AccessorPrivateToTorch)
        assert not hasattr(writer.backend, "_get_file_writer")
    writer.log_metrics({"lm loss": 2.5, "grad-norm": torch.tensor(0.75)}, 3)
    writer.log_metrics({}, 4)  # nothing to write
    writer.close()
    expected = [("lm loss", 2.5), ("grad-norm", 0.75)]
    if accessor == "present":
        assert _events(tmp_path) == [(3, expected)]
    else:
        assert _events(tmp_path) == [(3, [pair]) for pair in expected]


def test_process_mode_writes_records_in_the_writer_process(tmp_path: Path, kit: Any) -> None:
    writers = build_metric_writers(
        LoggerConfig(tensorboard_dir=str(tmp_path)), rank=0, world_size=1
    )
    (writer_pid,) = writers.writer_process_pids
    writers.log_metrics({"lm loss": 1.5}, 2)
    # The SummaryWriter for direct use (megatron's helpers) is a real one, in this process.
    direct = writers.tensorboard
    assert isinstance(direct, torch.utils.tensorboard.SummaryWriter)
    direct.add_scalar("moe/aux loss", 0.25, 2)
    writers.close()
    assert kit.read_tensorboard(tmp_path) == {"lm loss": [(2, 1.5)], "moe/aux loss": [(2, 0.25)]}
    by_pid = {int(path.name.split(".")[-2]): path for path in tmp_path.glob("events.out.*")}
    assert set(by_pid) == {writer_pid, os.getpid()}
    assert [tags for _, tags in _events(by_pid[writer_pid])] == [[("lm loss", 1.5)]]


class _Recorder(MetricWriter):
    """A custom backend that remembers what it was given."""

    kind = "recorder"

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    @property
    def backend(self) -> Any:
        return self.rows

    def add_scalar(self, tag: str, value: Any, step: int) -> None:
        self.rows.append((step, {tag: value}))

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        self.rows.append((step, dict(metrics)))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_log_many_keeps_order_and_honours_only(tmp_path: Path, kit: Any) -> None:
    built = build_metric_writers(LoggerConfig(tensorboard_dir=str(tmp_path)), rank=0, world_size=1)
    recorder = _Recorder()
    writers = MetricWriters([*built.writers, recorder])
    writers.log_many(
        [
            ({"x vs samples": 1.0}, 40, ("tensorboard",)),
            ({"x": torch.tensor(2.0)}, 5, None),
            ({}, 6, None),  # nothing to write
        ]
    )
    writers.close()
    assert recorder.rows == [(5, {"x": 2.0})]
    assert kit.read_tensorboard(tmp_path) == {"x vs samples": [(40, 1.0)], "x": [(5, 2.0)]}
