"""Write a small supervised-finetuning task as JSONL: single-digit addition.

Each record is ``{"input": "What is 3+4? ", "output": "7"}``: the answer is a function of
the prompt, so a model can learn it, and the loss on answer tokens measures how well it
did. ``training.jsonl``, ``validation.jsonl`` and ``test.jsonl`` are written to the output
directory (the layout ``FinetuningDatasetConfig.dataset_root`` expects); the same seed
writes the same files.

    python examples/data/make_sft_task.py --output examples/data/sft_addition
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SPLITS = {"training": 2000, "validation": 64, "test": 64}


def records(count: int, rng: random.Random) -> list[dict[str, str]]:
    """``count`` addition questions with their answers."""
    out = []
    for _ in range(count):
        a, b = rng.randrange(10), rng.randrange(10)
        out.append({"input": f"What is {a}+{b}? ", "output": str(a + b)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("examples/data/sft_addition"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    args.output.mkdir(parents=True, exist_ok=True)
    for split, count in SPLITS.items():
        lines = [json.dumps(r) for r in records(count, rng)]
        (args.output / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {', '.join(f'{s}.jsonl ({n})' for s, n in SPLITS.items())} to {args.output}")


if __name__ == "__main__":
    main()
