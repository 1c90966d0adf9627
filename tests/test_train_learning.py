"""The text-corpus recipe learns real text: on English prose (the Python standard library's
docstrings, generated locally by ``examples/data/make_docstring_corpus.py``), with the
byte-level tokenizer, the validation loss of a small GPT falls well below the corpus'
unigram entropy within a few hundred steps.

The corpus is tokenized and trained by ``examples/pretrain_text_corpus.sh``
(``bridge-preprocess-data``, then ``bridge-train`` with ``examples/recipes/gpt_text_corpus.yaml``),
as ``examples/README.md`` shows. A model that only knew byte frequencies would reach the
unigram entropy; a lower loss on held-out documents means it learned structure (spelling,
words, phrases).
"""

from __future__ import annotations

import collections
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bridge.train.metrics import read_metrics_file

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MAKE_CORPUS = EXAMPLES / "data" / "make_docstring_corpus.py"
SCRIPT = EXAMPLES / "pretrain_text_corpus.sh"
ITERATIONS = 500


def unigram_entropy(token_ids: list[int]) -> float:
    """Entropy (nats) of the token frequencies."""
    counts = collections.Counter(token_ids)
    total = len(token_ids)
    return -sum(c / total * math.log(c / total) for c in counts.values())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_text_corpus_example_learns_real_text_below_unigram_entropy(tmp_path: Path) -> None:
    corpus = tmp_path / "data" / "docstrings.jsonl"
    made = subprocess.run(
        [sys.executable, str(MAKE_CORPUS), "--output", str(corpus)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert made.returncode == 0, made.stderr
    documents = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    assert len(documents) > 1000
    # Byte-level tokens: the UTF-8 bytes of every document plus one <eod> (id 256).
    tokens = [b for doc in documents for b in [*doc.encode("utf-8"), 256]]
    entropy = unigram_entropy(tokens)
    assert 2.8 < entropy < 3.8, entropy  # English prose with some code

    # examples/pretrain_text_corpus.sh: bridge-preprocess-data, then bridge-train with
    # examples/recipes/gpt_text_corpus.yaml (checkpoints and TensorBoard under runs/).
    bin_dir = str(Path(sys.executable).parent)
    proc = subprocess.run(
        [
            "bash",
            str(SCRIPT),
            str(corpus),
            f"train.train_iters={ITERATIONS}",
            "train.eval_interval=250",
            "train.eval_iters=8",
            "--no-print-config",
            "--metrics-file",
            str(tmp_path / "metrics.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=tmp_path,
        env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "data" / "docstrings.bin").exists()
    records = read_metrics_file(tmp_path / "metrics.jsonl")
    validation = {
        int(r["step"]): r["lm loss validation"] for r in records if "lm loss validation" in r
    }
    assert sorted(validation) == [250, ITERATIONS]
    assert validation[ITERATIONS] < validation[250]
    assert validation[ITERATIONS] < 0.8 * entropy, (validation, entropy)
    ppl = [r["lm loss validation ppl"] for r in records if "lm loss validation ppl" in r]
    assert ppl[-1] == pytest.approx(math.exp(validation[ITERATIONS]), rel=1e-9)
    # Another corpus than the shipped one trains in a directory of its own.
    saved = tmp_path / "runs" / "gpt_text_corpus_docstrings"
    assert (saved / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERATIONS)
    assert list((tmp_path / "runs" / "gpt_text_corpus_docstrings_tb").glob("events.out.tfevents.*"))


def test_example_recipes_validate() -> None:
    from bridge.config import ConfigContainer

    worlds = {"gpt_tp2_dp2.yaml": 4}
    recipes = sorted((EXAMPLES / "recipes").glob("*.yaml"))
    assert recipes
    for path in recipes:
        cfg = ConfigContainer.from_yaml(path)
        cfg.validate(world_size=worlds.get(path.name, 1))
        assert cfg.dist.distributed_backend == "gloo", path.name
