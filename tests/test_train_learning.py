"""The text-corpus recipe learns: on the shipped corpus, with the byte-level tokenizer, the
validation loss of a small GPT falls well below the corpus' unigram entropy within 200 steps.

The corpus (``examples/data/tiny_corpus.txt``) is tokenized and trained by
``examples/pretrain_text_corpus.sh`` (``bridge-preprocess-data``, then ``bridge-train`` with
``examples/recipes/gpt_text_corpus.yaml``), as ``examples/README.md`` shows. A
model that only knew byte frequencies would reach the unigram entropy; a lower validation
loss on held-out documents means it learned structure (spelling, words, phrases).
"""

from __future__ import annotations

import collections
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bridge.train import read_metrics_file

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CORPUS = EXAMPLES / "data" / "tiny_corpus.txt"
SCRIPT = EXAMPLES / "pretrain_text_corpus.sh"


def unigram_entropy(token_ids: list[int]) -> float:
    """Entropy (nats) of the token frequencies."""
    counts = collections.Counter(token_ids)
    total = len(token_ids)
    return -sum(c / total * math.log(c / total) for c in counts.values())


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_text_corpus_example_learns_below_unigram_entropy(tmp_path: Path) -> None:
    # Byte-level tokens: the UTF-8 bytes of every line plus one <eod> (id 256) per document.
    lines = [line for line in CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()]
    tokens = [b for line in lines for b in [*line.encode("utf-8"), 256]]
    entropy = unigram_entropy(tokens)
    assert 2.5 < entropy < 3.5

    # examples/pretrain_text_corpus.sh: bridge-preprocess-data, then bridge-train with
    # examples/recipes/gpt_text_corpus.yaml (checkpoints and TensorBoard under runs/).
    bin_dir = str(Path(sys.executable).parent)
    proc = subprocess.run(
        [
            "bash",
            str(SCRIPT),
            str(CORPUS),
            "train.train_iters=200",
            "--no-print-config",
            "--metrics-file",
            str(tmp_path / "metrics.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=380,
        cwd=tmp_path,
        env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "data" / "tiny_corpus.bin").exists()
    records = read_metrics_file(tmp_path / "metrics.jsonl")
    validation = {
        int(r["step"]): r["lm loss validation"] for r in records if "lm loss validation" in r
    }
    assert sorted(validation) == [100, 200]
    assert validation[200] < validation[100]
    assert validation[200] < 0.6 * entropy, (validation, entropy)
    ppl = [r["lm loss validation ppl"] for r in records if "lm loss validation ppl" in r]
    assert ppl[-1] == pytest.approx(math.exp(validation[200]), rel=1e-9)
    saved = tmp_path / "runs" / "gpt_text_corpus"
    assert (saved / "latest_checkpointed_iteration.txt").read_text().strip() == "200"
    assert list((tmp_path / "runs" / "gpt_text_corpus_tb").glob("events.out.tfevents.*"))


def test_example_recipes_validate() -> None:
    from bridge.config import ConfigContainer

    worlds = {"gpt_tp2_dp2.yaml": 4}
    recipes = sorted((EXAMPLES / "recipes").glob("*.yaml"))
    assert recipes
    for path in recipes:
        cfg = ConfigContainer.from_yaml(path)
        cfg.validate(world_size=worlds.get(path.name, 1))
        assert cfg.dist.distributed_backend == "gloo", path.name
