"""Write a real English text corpus from the Python standard library's docstrings.

Every Python installation carries several megabytes of hand-written English prose: the
docstrings of its standard library. This script collects them (read with ``ast`` from the
source files, nothing is imported or downloaded) into a JSON-lines file, one document per
module, class or function docstring, in a fixed order, so the examples and tests can train
on real text on any machine, offline. The text is the Python Software Foundation's, under
the PSF License; the corpus is generated locally and not shipped.

Usage::

    python examples/data/make_docstring_corpus.py [--output PATH] [--max-bytes N]
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

# Documents shorter than this are mostly one-liners ("Return self.") that teach little.
MIN_CHARS = 200


def _docstrings(path: Path) -> Iterator[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    nodes: list[ast.AST] = [tree]
    nodes += [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
    ]
    for node in nodes:
        doc = ast.get_docstring(node, clean=True)  # type: ignore[arg-type]
        if doc and len(doc) >= MIN_CHARS and doc.isascii():
            yield doc


def stdlib_sources() -> list[Path]:
    """The standard library's ``.py`` files, sorted (tests, demos and vendored code left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages", "lib2to3", "turtledemo", "__phello__"}
    return sorted(
        path for path in root.rglob("*.py") if not skip.intersection(path.relative_to(root).parts)
    )


def write_corpus(output: Path, max_bytes: int) -> tuple[int, int]:
    """Write the corpus; returns ``(documents, bytes of text)``."""
    seen: set[str] = set()
    documents = total = 0
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("w", encoding="utf-8") as handle:
        for path in stdlib_sources():
            for doc in _docstrings(path):
                if doc in seen:
                    continue
                seen.add(doc)
                handle.write(json.dumps({"text": doc}) + "\n")
                documents += 1
                total += len(doc)
                if total >= max_bytes:
                    return documents, total
    return documents, total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("data/docstrings.jsonl"))
    parser.add_argument(
        "--max-bytes", type=int, default=2_000_000, help="stop after this much text"
    )
    args = parser.parse_args(argv)
    documents, total = write_corpus(args.output, args.max_bytes)
    if documents == 0:
        print(f"no docstrings found under {sysconfig.get_paths()['stdlib']}", file=sys.stderr)
        return 1
    print(f"wrote {documents} documents, {total} characters to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
