"""Shared fixtures of bridge-train's tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# Documents of the small corpus several data tests tokenize.
CORPUS_DOCUMENTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Megatron trains transformers; bridge makes it portable.",
    "Pack my box with five dozen liquor jugs!",
    "Sphinx of black quartz, judge my vow.",
    "How vexingly quick daft zebras jump.",
    "Unicode works too: naïve café, 数据, ✓.",
]


@pytest.fixture(scope="session")
def corpus_documents() -> list[str]:
    """The documents of the test corpus."""
    return list(CORPUS_DOCUMENTS)


@pytest.fixture
def corpus_jsonl(tmp_path: Path) -> Path:
    """The corpus as JSONL (one document per line under "text"), repeated for volume."""
    path = tmp_path / "corpus.jsonl"
    with path.open("w", encoding="utf-8") as handle:
        for _ in range(8):
            for doc in CORPUS_DOCUMENTS:
                handle.write(json.dumps({"text": doc, "id": len(doc)}) + "\n")
    return path
