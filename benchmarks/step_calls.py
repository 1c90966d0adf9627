"""Function calls per training iteration: the trainer against the bare loop, by owner.

``framework_overhead.py`` times the trainer against a bare loop; on a shared machine its
ratio moves by several percent from run to run (other processes, frequency scaling), more
than the framework's own cost. This script counts instead of timing, so its figures are
the same on every run of the same code: the Python functions and C built-ins each side
calls per iteration (``cProfile``'s call counts), grouped by who owns them:

* ``bridge``: this project's code (``bridge.*`` and ``core_utils``, except the emulation);
* ``emulation``: ``core_utils``' CUDA emulation (its device-rewriting mode sees every torch
  call of the thread on a machine without CUDA);
* ``megatron``: megatron-core (its DDP, optimizer, schedules, model);
* ``torch``: torch's Python code;
* ``builtins``: C functions called from Python (tensor operations, ``len``, dict lookups;
  under the emulation each torch operation is counted once more, called from its mode);
* ``other``: the standard library and everything else.

Each side runs once uncounted (first-use imports and caches, ``--steps`` iterations), then twice, for ``--steps``
and twice as many iterations; the difference of the two counts divided by ``--steps`` is
the per-iteration figure: setup, teardown and warm-up cancel out. Both sides are ``framework_overhead.py``'s (same model, data, optimizer
settings and console line every 10 iterations). A change that adds per-iteration work to
the trainer shows here as a larger ``bridge`` count, whatever the machine's load.

    uv run python benchmarks/step_calls.py [--steps 10]

It prints the counts and the ratio of all calls, trainer / bare, and never asserts them.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import importlib.util
import pstats
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist

_HERE = Path(__file__).resolve().parent
OWNERS = ("bridge", "emulation", "megatron", "torch", "builtins", "other")


def _framework_overhead() -> ModuleType:  # benchmarks/ is not a package: load by path
    spec = importlib.util.spec_from_file_location(
        "framework_overhead", _HERE / "framework_overhead.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def owner(filename: str) -> str:
    """The owner of a function, from the file ``cProfile`` records for it."""
    path = filename.replace("\\", "/")
    if path == "~":
        return "builtins"
    if "core_utils/cuda_emulation.py" in path:
        return "emulation"
    if "/bridge/" in path or "/core_utils/" in path:
        return "bridge"
    if "/megatron/core/" in path:
        return "megatron"
    if "/torch/" in path:
        return "torch"
    return "other"


def _calls(run: Callable[[], object]) -> collections.Counter[str]:
    profile = cProfile.Profile()
    profile.enable()
    run()
    profile.disable()
    counts: collections.Counter[str] = collections.Counter()
    for (filename, _, _), (_, calls, *_) in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        counts[owner(filename)] += calls
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="iterations of the shorter run")
    args = parser.parse_args()
    overhead = _framework_overhead()
    torch.set_num_threads(1)
    overhead.one_process_group()
    per_step: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for side in ("bare", "trainer"):
            counts = []
            for steps in (args.steps, args.steps, 2 * args.steps):
                run = (
                    functools.partial(overhead.run_bare, steps, 1)
                    if side == "bare"
                    else functools.partial(overhead.run_trainer, steps, 1, Path(tmp))
                )
                counts.append(_calls(run))
            per_step[side] = {k: (counts[2][k] - counts[1][k]) / args.steps for k in OWNERS}
    dist.destroy_process_group()

    print(f"\ncalls per iteration ({args.steps} vs {2 * args.steps} iterations per side)")
    print(f"{'owner':10s} {'bare':>10s} {'trainer':>10s} {'added':>10s}")
    for key in OWNERS:
        bare, trainer = per_step["bare"][key], per_step["trainer"][key]
        print(f"{key:10s} {bare:10.0f} {trainer:10.0f} {trainer - bare:10.0f}")
    total = {side: sum(per_step[side].values()) for side in per_step}
    print(
        f"{'all':10s} {total['bare']:10.0f} {total['trainer']:10.0f} "
        f"{total['trainer'] - total['bare']:10.0f}"
    )
    print(f"ratio trainer / bare, all calls: {total['trainer'] / total['bare']:.2f}")


if __name__ == "__main__":
    main()
