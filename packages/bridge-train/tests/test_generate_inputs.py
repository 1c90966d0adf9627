"""bridge-generate's inputs without a model: prompts, chat rendering, options, --help."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bridge.train.data.tokenizers import ByteLevelTokenizer
from bridge.train.generate.errors import GenerationError
from bridge.train.generate.options import SamplingOptions
from bridge.train.generate.prompts import PromptSpec, read_prompts_file, render_prompts


def test_prompt_files_lines_and_json_lines(tmp_path: Path) -> None:
    lines = tmp_path / "prompts.txt"
    lines.write_text("first prompt\n\n  second, indented\n")
    assert read_prompts_file(lines) == [
        PromptSpec("first prompt"),
        PromptSpec("  second, indented"),
    ]
    records = tmp_path / "prompts.jsonl"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    records.write_text(
        "\n".join(
            json.dumps(r)
            for r in ({"prompt": "a\nb"}, {"text": "c"}, {"input": "d"}, {"messages": chat}, "e")
        )
    )
    assert read_prompts_file(records) == [
        PromptSpec("a\nb"),
        PromptSpec("c"),
        PromptSpec("d"),
        PromptSpec("Hi", tuple(chat)),
        PromptSpec("e"),
    ]


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json\n", "line 1: not valid JSON"),
        ('{"answer": 1}\n', "line 1: needs a 'prompt'"),
        ('{"messages": []}\n', "'messages' must be a non-empty list"),
        ("\n\n", "holds no prompt"),
    ],
)
def test_bad_prompt_files_are_one_line(tmp_path: Path, content: str, needle: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(GenerationError, match=needle):
        read_prompts_file(path)
    with pytest.raises(GenerationError, match="does not exist"):
        read_prompts_file(tmp_path / "missing.txt")


def test_chat_prompts_render_as_chat_training_records() -> None:
    tokenizer = ByteLevelTokenizer()
    rendered = render_prompts(
        [PromptSpec("Hi"), PromptSpec("x", ({"role": "user", "content": "2+2?"},))],
        tokenizer,
        chat=True,
    )
    assert rendered[0] == tokenizer.tokenize("<|user|>\nHi\n<|assistant|>\n")
    assert rendered[1] == tokenizer.tokenize("<|user|>\n2+2?\n<|assistant|>\n")
    assert render_prompts([PromptSpec("Hi")], tokenizer, chat=False) == ["Hi"]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"max_new_tokens": 0}, "--max-new-tokens"),
        ({"max_new_tokens": 4, "greedy": False, "temperature": 0.0}, "--temperature"),
        ({"max_new_tokens": 4, "greedy": False, "top_k": 3, "top_p": 0.5}, "--top-k and --top-p"),
        ({"max_new_tokens": 4, "greedy": False, "top_p": 1.5}, "--top-p"),
        ({"max_new_tokens": 4, "temperature": 0.5}, "--greedy"),
        ({"max_new_tokens": 4, "stop": ("",)}, "--stop"),
    ],
)
def test_contradictory_options_are_refused(kwargs: dict, needle: str) -> None:
    with pytest.raises(GenerationError, match=needle):
        SamplingOptions(**kwargs)


def test_help_is_fast_and_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "from bridge.train.generate import cli\n"
        "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules and 'megatron' not in sys.modules, 'heavy import'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--max-new-tokens" in done.stdout and "--top-p" in done.stdout


def test_greedy_with_sampling_flags_is_a_usage_error() -> None:
    from bridge.train.generate import cli

    with pytest.raises(SystemExit) as exc:
        cli.run(["ckpt", "--max-new-tokens", "4", "--greedy", "--seed", "3"])
    assert exc.value.code == 2


def test_completion_text_is_what_the_new_tokens_add_to_the_prompt() -> None:
    from bridge.train.data.tokenizers import NullTokenizer
    from bridge.train.generate.controller import continuation_text

    # The null tokenizer separates ids by spaces: the separator belongs to the completion.
    assert continuation_text(NullTokenizer(64), [1, 2, 3], [4, 5]) == " 4 5"
    byte_level = ByteLevelTokenizer()
    prompt = byte_level.tokenize("Caf")
    assert continuation_text(byte_level, prompt, byte_level.tokenize("é!")) == "é!"
    assert continuation_text(byte_level, prompt, []) == ""
