"""Prompts from the command line, a file or standard input, and chat prompts.

A prompts file is JSON lines when its name ends in ``.jsonl`` (one object per line: a
``"prompt"``, ``"text"`` or ``"input"`` string, or a chat ``"messages"`` list), else one
prompt per line (blank lines skipped). A chat prompt (``--chat``, or a ``messages`` record)
is rendered as the chat records of supervised finetuning are
(:func:`bridge.train.data.sft.chat_generation_prompt`), followed by the start of the
assistant's answer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bridge.train.data.sft import chat_generation_prompt
from bridge.train.data.tokenizers import Tokenizer
from bridge.train.generate.errors import GenerationError

__all__ = ["PromptSpec", "parse_prompt_lines", "read_prompts_file", "render_prompts"]

_TEXT_KEYS = ("prompt", "text", "input")


@dataclass(frozen=True)
class PromptSpec:
    """One prompt as given.

    Attributes:
        text: The prompt text (for a chat record, its last message's content).
        messages: Chat messages to render, or ``None`` for a plain text prompt.
    """

    text: str
    messages: tuple[dict[str, str], ...] | None = None


def _record(where: str, record: Any) -> PromptSpec:
    if isinstance(record, str):
        return PromptSpec(record)
    if not isinstance(record, dict):
        raise GenerationError(f"{where}: expected a JSON object or string")
    messages = record.get("messages")
    if messages is not None:
        if (
            not isinstance(messages, list)
            or not messages
            or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
                for m in messages
            )
        ):
            raise GenerationError(
                f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects"
            )
        chat = tuple({"role": m["role"], "content": str(m["content"])} for m in messages)
        return PromptSpec(chat[-1]["content"], chat)
    for key in _TEXT_KEYS:
        if isinstance(record.get(key), str):
            return PromptSpec(record[key])
    raise GenerationError(
        f"{where}: needs a 'prompt' (or 'text', 'input') string or a 'messages' list"
    )


def parse_prompt_lines(lines: Iterable[str], name: str, *, jsonl: bool) -> list[PromptSpec]:
    """Prompts from the lines of a file (see the module docstring).

    Raises:
        GenerationError: A JSON line that is not valid or has no prompt.
    """
    prompts = []
    for number, line in enumerate(lines, start=1):
        text = line.rstrip("\r\n")
        if not text.strip():
            continue
        if not jsonl:
            prompts.append(PromptSpec(text))
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise GenerationError(f"{name} line {number}: not valid JSON ({exc.msg})") from None
        prompts.append(_record(f"{name} line {number}", record))
    return prompts


def read_prompts_file(path: str | os.PathLike[str]) -> list[PromptSpec]:
    """The prompts of a file (JSON lines for ``*.jsonl``, else one per line).

    Raises:
        GenerationError: The file is missing, unreadable, empty or malformed.
    """
    file = Path(path)
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise GenerationError(f"--prompts-file {file} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise GenerationError(f"--prompts-file {file} cannot be read: {exc}") from None
    prompts = parse_prompt_lines(lines, str(file), jsonl=file.suffix == ".jsonl")
    if not prompts:
        raise GenerationError(f"--prompts-file {file} holds no prompt")
    return prompts


def render_prompts(
    prompts: Sequence[PromptSpec], tokenizer: Tokenizer, *, chat: bool
) -> list[str | list[int]]:
    """What :meth:`TextGenerator.generate` takes: texts, or token ids of chat prompts.

    Args:
        prompts: The prompts.
        tokenizer: The checkpoint's tokenizer.
        chat: Render plain prompts as one user message each.
    """

    rendered: list[str | list[int]] = []
    for index, prompt in enumerate(prompts):
        messages = prompt.messages
        if messages is None and chat:
            messages = ({"role": "user", "content": prompt.text},)
        if messages is None:
            rendered.append(prompt.text)
            continue
        try:
            rendered.append(chat_generation_prompt(tokenizer, list(messages)))
        except ValueError as exc:
            raise GenerationError(f"prompt {index + 1}: {exc}") from None
    return rendered
