"""NVTX ranges (no-ops unless enabled; stack checks on CPU) and the asyncio helpers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator

import pytest
import torch

import core_utils
import core_utils.async_utils as async_utils
import core_utils.nvtx as nvtx


@pytest.fixture
def nvtx_enabled() -> Iterator[None]:
    core_utils.configure_nvtx_profiling(True)
    nvtx._nvtx_range_messages.clear()
    yield
    core_utils.configure_nvtx_profiling(False)
    nvtx._nvtx_range_messages.clear()


def test_disabled_nvtx_does_nothing() -> None:
    core_utils.configure_nvtx_profiling(False)
    core_utils.nvtx_range_pop("never pushed")  # no stack check when disabled
    core_utils.nvtx_range_push("x")
    assert nvtx._nvtx_range_messages == []


def test_enabled_nvtx_tracks_ranges(nvtx_enabled: None, monkeypatch: pytest.MonkeyPatch) -> None:
    emitted: list[tuple[str, str | None]] = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda m: emitted.append(("push", m)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: emitted.append(("pop", None)))
    core_utils.nvtx_range_push("outer")
    core_utils.nvtx_range_push("inner", suffix="fwd")
    assert nvtx._nvtx_range_messages == ["outer", "inner.fwd"]
    with pytest.raises(
        ValueError,
        match=r"nvtx_range_pop\('outer'\) does not match the innermost open range 'inner\.fwd'",
    ):
        core_utils.nvtx_range_pop("outer")
    core_utils.nvtx_range_push("inner", suffix="fwd")
    core_utils.nvtx_range_pop("inner", suffix="fwd")
    core_utils.nvtx_range_pop("outer")
    with pytest.raises(RuntimeError, match="no NVTX range is open"):
        core_utils.nvtx_range_pop("outer")
    # Without a message, the calling function's path names the range.
    core_utils.nvtx_range_push()
    assert nvtx._nvtx_range_messages == [f"{__name__}.test_enabled_nvtx_tracks_ranges"]
    core_utils.nvtx_range_pop()
    if torch.cuda.is_available():
        assert ("push", "outer") in emitted
    else:
        assert emitted == []  # nothing reaches the profiler without CUDA


def test_nvtx_decorator_checks_at_call_time(nvtx_enabled: None) -> None:
    seen: list[list[str]] = []

    @core_utils.nvtx_decorator()
    def step() -> int:
        seen.append(list(nvtx._nvtx_range_messages))
        return 7

    @core_utils.nvtx_decorator(message="custom", color="blue")
    def other() -> None:
        seen.append(list(nvtx._nvtx_range_messages))

    assert step() == 7
    other()
    assert seen[0] == [f"{__name__}.step"]
    assert seen[1] == ["custom"]
    assert nvtx._nvtx_range_messages == []
    core_utils.configure_nvtx_profiling(False)
    step()
    assert seen[2] == []


def test_get_asyncio_loop_reuses_one_loop() -> None:
    loop = core_utils.get_asyncio_loop()
    assert core_utils.get_asyncio_loop() is loop
    assert async_utils._ASYNC_IO_LOOP is loop
    other = asyncio.new_event_loop()
    try:
        assert core_utils.get_asyncio_loop(other) is other

        async def inside() -> asyncio.AbstractEventLoop:
            return core_utils.get_asyncio_loop()

        assert other.run_until_complete(inside()) is other
    finally:
        other.close()


def test_trace_async_exceptions_surfaces_task_errors(caplog: pytest.LogCaptureFixture) -> None:
    @core_utils.trace_async_exceptions
    async def failing() -> None:
        raise KeyError("lost in a task")

    async def main() -> None:
        task = asyncio.get_running_loop().create_task(failing())
        await asyncio.sleep(0.05)  # nobody awaits the task
        assert task.done()
        task.exception()  # retrieved here only to keep asyncio quiet

    with caplog.at_level(logging.ERROR, logger="core_utils.async_utils"):
        asyncio.run(main())
    assert "exception in async function" in caplog.text and "failing" in caplog.text
    assert "KeyError: 'lost in a task'" in caplog.text  # traceback included


def test_trace_async_exceptions_reraises_and_counts(caplog: pytest.LogCaptureFixture) -> None:
    @core_utils.trace_async_exceptions(verbose=True)
    async def work(x: int) -> int:
        return x * 2

    @core_utils.trace_async_exceptions
    async def gen(n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i
        raise ValueError("generator broke")

    @core_utils.trace_async_exceptions
    async def boom() -> None:
        raise RuntimeError("visible to the awaiter")

    async def main() -> list[int]:
        results = [await work(i) for i in range(10)]
        with pytest.raises(RuntimeError, match="visible to the awaiter"):
            await boom()
        items = []
        with pytest.raises(ValueError, match="generator broke"):
            async for item in gen(3):
                items.append(item)
        assert items == [0, 1, 2]
        return results

    with caplog.at_level(logging.INFO, logger="core_utils.async_utils"):
        assert asyncio.run(main()) == [2 * i for i in range(10)]
    name = work.__qualname__
    assert async_utils._ASYNC_TASK_STATS[name][0] == 10
    lifetime_logs = [r.getMessage() for r in caplog.records if "lifetime cnt" in r.getMessage()]
    assert len(lifetime_logs) == 2  # the 1st and the 10th completion
    assert "exception in async generator" in caplog.text
    with pytest.raises(TypeError, match="decorates async functions"):
        core_utils.trace_async_exceptions(lambda: None)
