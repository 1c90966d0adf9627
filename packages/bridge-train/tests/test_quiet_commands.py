"""Third-party notices are held back outside ``bridge-train`` too (each in a fresh process,
where torch and megatron-core are imported for the first time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Let the children cache bytecode (as nox does): recompiling torch costs most of a start.
_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "RANK")}


def _python(script: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=_ENV,
        cwd=cwd,
    )


@pytest.mark.timeout(300)
def test_convert_help_imports_neither_torch_nor_megatron() -> None:
    # Importing the command's package imported the converter (torch, megatron-core): 7 s.
    proc = _python(
        """
        import contextlib, io, json, runpy, sys
        from bridge.train.convert.cli import main
        with contextlib.redirect_stdout(io.StringIO()) as out:
            try:
                main(["--help"])
            except SystemExit as exc:
                code = exc.code
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "megatron"))
        # `python -m bridge.train.convert --help`: the same command, the same help.
        sys.argv = ["python -m bridge.train.convert", "--help"]
        with contextlib.redirect_stdout(io.StringIO()) as via_m:
            try:
                runpy.run_module("bridge.train.convert", run_name="__main__", alter_sys=True)
            except SystemExit as exc:
                m_code = exc.code
        same = via_m.getvalue() == out.getvalue()
        print(json.dumps([code, "import" in out.getvalue(), heavy[:3], m_code, same]))
        """
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == [0, True, [], 0, True]


@pytest.mark.timeout(300)
def test_the_python_api_imports_quietly() -> None:
    # A script that loads a recipe and imports the entry points saw about 17 notices.
    proc = _python(
        """
        import logging
        from bridge.config import load_config
        from bridge.train import GPTModelProvider, pretrain
        from bridge.train.recipes import recipe_path

        cfg = load_config(recipe_path("tiny_gpt"), ["train.train_iters=2"])
        print(type(cfg.model).__name__, pretrain.__name__)
        """
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["GPTModelProvider", "pretrain"]
    assert proc.stderr == "", proc.stderr


@pytest.mark.timeout(300)
def test_preprocess_prints_its_result_and_one_notice_line(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("one line\nanother line\n")
    proc = _python(
        """
        import sys
        from bridge.train.data.preprocess import main
        sys.exit(main(sys.argv[1:]))
        """,
        "--input",
        str(corpus),
        "--split-lines",
        "--output-prefix",
        str(tmp_path / "out"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("wrote 2 documents, ")
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("bridge-preprocess-data: ") and "held back" in lines[0]
    assert lines[0].endswith("--verbose prints them")
