"""Start-up time of the ``bridge-train`` command against ``python -c "import torch"``.

Four commands run as fresh processes, alternating round by round so machine noise hits all
of them alike; the median wall time of each is reported with its ratio to the baseline
(importing torch, the least any PyTorch program pays):

* ``import torch``: the baseline;
* ``bridge-train --help``;
* ``bridge-train trian.train_iters=5``: a typo in an override (a configuration error);
* ``bridge-train train.train_iters=1 ...``: the default recipe up to its first iteration
  line (the process is stopped there; it measures imports, config, process group, model,
  data and the first step).

The first three should cost a fraction of the baseline: they never import torch or
megatron-core. The first iteration costs a few times the baseline (megatron-core's import
is most of it).

    uv run python benchmarks/startup.py [--rounds 3]

The script prints the figures and never asserts them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _command() -> list[str]:
    script = Path(sys.executable).with_name("bridge-train")
    return [str(script)] if script.exists() else [sys.executable, "-m", "bridge.train"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}


def _time_to_exit(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, capture_output=True, check=False, env=_env(), timeout=600)
    return time.perf_counter() - start


def _time_to_first_iteration(argv: list[str], cwd: str) -> float:
    start = time.perf_counter()
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env(), cwd=cwd
    )
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            if "iteration        1/" in line:
                return time.perf_counter() - start
        raise RuntimeError(f"{argv} ended (code {proc.wait()}) before its first iteration")
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    """Run the comparison and print one line per command."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cmd = _command()
    first_iteration = [*cmd, "train.train_iters=1", "train.eval_iters=0", "logger.log_interval=1"]
    times: dict[str, list[float]] = {
        "import torch": [],
        "--help": [],
        "config error": [],
        "first iteration": [],
    }
    with tempfile.TemporaryDirectory() as cwd:
        for _ in range(args.rounds):
            times["import torch"].append(_time_to_exit([sys.executable, "-c", "import torch"]))
            times["--help"].append(_time_to_exit([*cmd, "--help"]))
            times["config error"].append(_time_to_exit([*cmd, "trian.train_iters=5"]))
            times["first iteration"].append(_time_to_first_iteration(first_iteration, cwd))
    base = statistics.median(times["import torch"])
    print(f"startup ({args.rounds} rounds, median wall time, ratio to `import torch`):")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:<16} {median:7.2f} s   ratio {median / base:5.2f}")


if __name__ == "__main__":
    main()
