"""Device-to-host synchronisations per training iteration of ``bridge.train.pretrain``.

On a GPU every ``.item()``, ``.tolist()``, ``.cpu()``, ``float(t)``, ``int(t)``, ``bool(t)``
(a tensor truth test: ``if t:``), ``.numpy()`` or ``.to("cpu")`` of a device tensor makes
the host wait until the device has finished all queued work, so the framework cannot run
ahead of the kernels. Megatron-LM brought its count from 142 to 38 per iteration; this
project's goal (issue 13) is at most 5 on an iteration that does not log, with the loss and
grad norm kept on the device until a log line needs them.

The count is taken on CPU, where nothing actually waits, by the operations themselves: a
``TorchFunctionMode`` is entered when an iteration's first micro-batch is fetched and left
when the next iteration's first micro-batch is fetched, so the window covers the whole
iteration (forward, backward, optimizer step) and everything the loop does after it
(metrics, logging, checkpoint and exit decisions, callbacks). Two windows are reported: a
steady-state iteration that does not log, and one that writes the console log line. The
call sites (the innermost frame outside torch) are listed with their counts.

    uv run python benchmarks/host_syncs.py [--log-interval 10]

The trainer runs on megatron-core's engine (on CPU under core-utils' CUDA emulation).

It prints the counts and never asserts them.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from bridge.config import LoggerConfig
from bridge.train import forward_step, pretrain
from bridge.train.testing import tiny_config_container, tiny_train_config

# Tensor methods whose result needs the tensor's value on the host.
_SYNCING = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.__format__,
}


def _is_host_copy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if func in _SYNCING:
        return True
    if func is torch.Tensor.to:
        # Only a literal "cpu" says "to the host": a torch.device argument is the training
        # device, which on this CPU machine is the host too (on a GPU it is a host-to-device
        # copy of a batch, which needs no wait).
        targets = [*args[1:], kwargs.get("device")]
        return any(isinstance(t, str) and t.startswith("cpu") for t in targets)
    return False


def _call_site() -> str | None:
    """The innermost frame that is not torch or this script: who asked for the value.

    ``None`` inside ``torch.optim``: its per-parameter ``step`` counters are CPU tensors on
    a GPU as well, so reading them is no device synchronisation.
    """
    stack = traceback.extract_stack()[:-3]
    if any("/torch/optim/" in frame.filename for frame in stack[-6:]):
        return None
    return describe_caller(stack, ("/torch/", __file__))


def describe_caller(
    stack: list[traceback.FrameSummary], skip: tuple[str, ...], depth: int = 1
) -> str:
    """``file:line (function)`` of the innermost frame of ``stack`` whose file name contains
    none of ``skip``, followed by its ``depth - 1`` callers (``a <- b``); ``?`` if none."""
    callers = [f for f in stack if not any(part in f.filename for part in skip)]
    if not callers:
        return "?"
    names = [
        f"{f.filename.split('site-packages/')[-1].split('/src/')[-1]}:{f.lineno} ({f.name})"
        for f in callers[-depth:]
    ]
    return " <- ".join(reversed(names))


class SyncCounter(TorchFunctionMode):
    """Counts host-value requests on tensors, by call site."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if _is_host_copy(func, args, kwargs):
            site = _call_site()
            if site is not None:
                self.sites[site] += 1
        return func(*args, **kwargs)


class _IterationWindows:
    """Wraps the forward step; counts syncs over chosen whole iterations."""

    def __init__(self, num_microbatches: int, windows: dict[str, int]) -> None:
        self.num_microbatches = num_microbatches
        self.windows = windows  # label -> completed steps when the window opens
        self.calls = 0
        self.open: tuple[str, SyncCounter] | None = None
        self.counts: dict[str, collections.Counter[str]] = {}

    def wrap(self, step: Callable[..., Any]) -> Callable[..., Any]:
        def counted(state: Any, data_iterator: Any, model: Any) -> Any:
            if model.training and self.calls % self.num_microbatches == 0:
                self._iteration_starts(state.train_state.step)
            if model.training:
                self.calls += 1
            return step(state, data_iterator, model)

        return counted

    def _iteration_starts(self, completed: int) -> None:
        if self.open is not None:
            label, counter = self.open
            counter.__exit__(None, None, None)
            self.counts[label] = counter.sites
            self.open = None
        for label, at in self.windows.items():
            if at == completed:
                counter = SyncCounter()
                counter.__enter__()
                self.open = (label, counter)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-interval", type=int, default=10)
    args = parser.parse_args()
    interval = args.log_interval
    # Window "n" opens when n steps are complete and covers step n+1 and the work after it.
    windows = {
        "iteration without a log line": 2 * interval + 2,
        "iteration with a log line": 3 * interval - 1,
    }
    steps = 3 * interval + 2
    micro, global_batch = 2, 4
    cfg = tiny_config_container(
        train=tiny_train_config(
            train_iters=steps,
            micro_batch_size=micro,
            global_batch_size=global_batch,
        ),
        logger=LoggerConfig(log_interval=interval),
    )
    counter = _IterationWindows(global_batch // micro, windows)
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        code = pretrain(cfg, counter.wrap(forward_step), metrics_file=Path(tmp) / "metrics.jsonl")
    if code != 0:
        sys.exit(f"pretrain exited with {code}")
    for label in windows:
        sites = counter.counts.get(label, collections.Counter())
        print(f"{label}: {sum(sites.values())} host synchronisations")
        for site, n in sites.most_common():
            print(f"  {n:4d}  {site}")
    print("goal (issue 13): <= 5 on an iteration without a log line; Megatron-LM: 38")


if __name__ == "__main__":
    main()
