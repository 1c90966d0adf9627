"""The ``bridge-generate`` command (also ``python -m bridge.train.generate``).

::

    bridge-generate CKPT_DIR [--prompt TEXT ...] [--prompts-file F] --max-new-tokens N
                    [--greedy | --temperature T --top-p P --top-k K --seed S]
                    [--stop TEXT ...] [--ignore-eod] [--chat] [--json] [--no-stream]
                    [--batch-size N] [--tp N] [--pp N] [--tokenizer PATH]

Prompts come from ``--prompt`` (repeatable), ``--prompts-file`` (one per line, or JSON lines
for ``*.jsonl``), standard input when it is piped, or, at a terminal with neither, an
interactive prompt (one completion per line entered; Ctrl-D ends). Text output streams the
completion as it is generated when one prompt is generated at a time; ``--json`` prints one
JSON object per prompt instead: ``{"prompt", "completion", "token_ids", "finish_reason"}``.
Launched bare it runs one process; under ``torchrun`` the processes form one tensor-parallel
(``--tp``, default: all of them) model and rank 0 prints.

``--help`` answers without importing torch. Exit codes: 0 done, 2 a checkpoint, prompt or
option that cannot be used (one line on stderr), 130 interrupted, 1 anything else.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

from bridge.config import LoggerConfig
from bridge.config.notices import held_notices, silence_known_fallback_notices
from bridge.train.cli import EXIT_CONFIG_ERROR, EXIT_INTERRUPTED, USER_ERROR_TYPES, raised_as

if TYPE_CHECKING:  # bridge.train.data imports torch: `bridge-generate --help` stays fast
    from bridge.train.data.tokenizers import Tokenizer

__all__ = ["build_parser", "main"]

_PROG = "bridge-generate"
_SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "seed")
_GENERATION_ERROR = ("bridge.train.generate.errors", "GenerationError")


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``bridge-generate``."""
    parser = argparse.ArgumentParser(
        prog=_PROG,
        description="Generate text from a bridge-train checkpoint (pretrained, finetuned, "
        "LoRA, or imported from Hugging Face) with the tokenizer it was trained with.",
        epilog=(
            "examples:\n"
            "  bridge-generate runs/a --prompt 'Once upon a time' --max-new-tokens 64\n"
            "  bridge-generate runs/a --prompts-file prompts.jsonl --max-new-tokens 32 --json\n"
            "  bridge-generate runs/sft --chat --prompt 'What is 2+2?' --max-new-tokens 16\n"
            "  bridge-generate runs/a --prompt Hi --max-new-tokens 20 --temperature 0.8 "
            "--top-p 0.9 --seed 1\n"
            "  torchrun --nproc-per-node=2 -m bridge.train.generate runs/a --prompt Hi "
            "--max-new-tokens 20\n\n"
            "See docs/generate.md."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("ckpt_dir", metavar="CKPT_DIR", help="checkpoint directory or iter_*")
    parser.add_argument(
        "--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeatable)"
    )
    parser.add_argument(
        "--prompts-file",
        metavar="F",
        help="prompts, one per line; JSON lines ('prompt' or 'messages') for *.jsonl",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, required=True, metavar="N", help="tokens per completion"
    )
    parser.add_argument("--greedy", action="store_true", help="most likely token (the default)")
    parser.add_argument("--temperature", type=float, metavar="T", help="sample at temperature T")
    parser.add_argument("--top-p", type=float, metavar="P", help="sample from the top-p mass")
    parser.add_argument("--top-k", type=int, metavar="K", help="sample from the top k tokens")
    parser.add_argument("--seed", type=int, metavar="S", help="sampling seed (reproducible)")
    parser.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)"
    )
    for flag, text in (
        ("--ignore-eod", "keep generating past the end-of-document token"),
        ("--chat", "render each prompt as a user message the way chat finetuning data is rendered"),
        ("--json", "one JSON object per prompt: prompt, completion, token_ids, finish_reason"),
        ("--no-stream", "print completions when they are finished"),
    ):
        parser.add_argument(flag, action="store_true", help=text)
    parser.add_argument(
        "--batch-size", type=int, default=8, metavar="N", help="prompts generated together"
    )
    parser.add_argument(
        "--tp", type=int, default=None, metavar="N", help="tensor-parallel size (default: all)"
    )
    parser.add_argument("--pp", type=int, default=1, metavar="N", help="pipeline size (GPU)")
    parser.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="the tokenizer directory/file to use instead of the one the run config names",
    )
    return parser


def _options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Any:
    from bridge.train.generate.options import SamplingOptions

    given = {
        name: getattr(args, name) for name in _SAMPLING_FLAGS if getattr(args, name) is not None
    }
    if args.greedy and given:
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in given)
        parser.error(f"--greedy cannot be combined with {flags}")
    # A sampling flag left out keeps SamplingOptions' default.
    return SamplingOptions(
        args.max_new_tokens,
        greedy=not given,
        stop=tuple(args.stop),
        stop_at_eod=not args.ignore_eod,
        **given,
    )


def _piped_prompts(stdin: TextIO) -> list[Any] | None:
    """The prompts piped to standard input; ``None``: interactive."""
    from bridge.train.generate.prompts import parse_prompt_lines
    from core_utils.distributed import broadcast_from_rank0

    # Rank 0 decides (its stdin is the user's) and reads a pipe; the others get its answer.
    piped = None
    if _rank() == 0 and not stdin.isatty():
        piped = parse_prompt_lines(stdin.read().splitlines(), "<stdin>", jsonl=False)
    return broadcast_from_rank0(piped)


def _write(out: TextIO | None, text: str) -> None:
    """Rank 0's output (``out`` is ``None`` on the other ranks)."""
    if out is not None:
        out.write(text)
        out.flush()


def _run_batch(
    generator: Any,
    specs: list[Any],
    rendered: list[Any],
    options: Any,
    out: TextIO | None,
    as_json: bool,
    stream: bool,
) -> None:
    """Generate and print: streamed text, finished completions, or JSON lines."""
    if stream and len(specs) == 1 and not as_json:
        # The prompt is printed with the first new text, once the prompt has been accepted
        # (a refused prompt leaves only its error line).
        pending = [_shown(specs[0], rendered[0], generator.tokenizer)]

        def on_text(index: int, delta: str, done: bool) -> None:
            _write(out, (pending.pop() if pending else "") + delta + ("\n" if done else ""))

        generator.generate(rendered, options, on_text=on_text)
        return
    for first in range(0, len(specs), generator.max_batch_size):
        part = slice(first, first + generator.max_batch_size)
        for index, completion in enumerate(generator.generate(rendered[part], options), first):
            shown = _shown(specs[index], rendered[index], generator.tokenizer)
            if as_json:
                record = {
                    "prompt": shown,
                    "completion": completion.text,
                    "token_ids": completion.token_ids,
                    "finish_reason": completion.finish_reason,
                }
                _write(out, json.dumps(record, ensure_ascii=False) + "\n")
            else:
                header = f"=== {index + 1}/{len(specs)} ===\n" if len(specs) > 1 else ""
                _write(out, f"{header}{shown}{completion.text}\n")


def _shown(spec: Any, rendered: Any, tokenizer: Tokenizer) -> str:
    """The prompt as printed: the text given, or the rendered chat prompt."""
    return spec.text if isinstance(rendered, str) else str(tokenizer.detokenize(rendered))


def _interactive(generator: Any, options: Any, out: TextIO | None, chat: bool) -> None:
    from bridge.train.generate.errors import GenerationError
    from bridge.train.generate.prompts import PromptSpec, render_prompts
    from core_utils.distributed import broadcast_from_rank0

    if out is not None:
        print(f"{_PROG}: enter a prompt per line; Ctrl-D ends", file=sys.stderr, flush=True)
    while True:
        line: str | None = None
        if _rank() == 0:
            try:
                line = input("> ")
            except EOFError:
                line = None
        line = broadcast_from_rank0(line)
        if line is None:
            return
        if not line.strip():
            continue
        spec = PromptSpec(line)
        try:
            rendered = render_prompts([spec], generator.tokenizer, chat=chat)
            _run_batch(generator, [spec], rendered, options, out, False, stream=True)
        except GenerationError as exc:  # one bad prompt does not end the session
            if out is not None:
                print(f"{_PROG}: error: {exc}", file=sys.stderr, flush=True)


def run(argv: Sequence[str] | None = None, *, stdin: TextIO | None = None) -> int:
    """Parse ``argv``, load the checkpoint, generate, and return the exit code.

    Raises:
        GenerationError: (and the checkpoint and config errors) for :func:`main` to report.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    stdin = sys.stdin if stdin is None else stdin
    options = _options(args, parser)

    # Other libraries' notices (megatron's GPTModel deprecation and tensor-parallel advice,
    # torch.distributed's deprecations and ShardedTensor notice while dist_checkpointing
    # loads) say nothing a user of this command can act on; the filters are set before the
    # held block, which restores the filters it found when it ends.
    warnings.filterwarnings("ignore", message=".*ShardedTensor", category=FutureWarning)
    warnings.filterwarnings("ignore", module=r"megatron\.|torch\.distributed\.")
    with held_notices():
        from bridge.logging import setup_logging
        from bridge.train.generate.loading import load_generation_model
        from bridge.train.generate.prompts import PromptSpec, read_prompts_file, render_prompts

        setup_logging(LoggerConfig())
        given = [PromptSpec(text) for text in args.prompt]
        if args.prompts_file is not None:  # a bad file is refused before loading
            given += read_prompts_file(args.prompts_file)
        silence_known_fallback_notices()
        loaded = load_generation_model(
            args.ckpt_dir,
            tensor_model_parallel_size=args.tp,
            pipeline_model_parallel_size=args.pp,
            tokenizer_model=args.tokenizer,
        )
    try:
        generator = loaded.generator(args.batch_size)
        out = sys.stdout if _rank() == 0 else None
        if out is not None:
            merged = ", LoRA adapters merged" if loaded.adapters_merged else ""
            print(
                f"{_PROG}: {loaded.checkpoint} (iteration {loaded.iteration}{merged}), "
                f"{type(loaded.tokenizer).__name__}",
                file=sys.stderr,
                flush=True,
            )
        specs = given or _piped_prompts(stdin)
        if specs is None:
            _interactive(generator, options, out, args.chat)
            return 0
        rendered = render_prompts(specs, loaded.tokenizer, chat=args.chat)
        _run_batch(generator, specs, rendered, options, out, args.json, not args.no_stream)
        return 0
    finally:
        loaded.close()


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``bridge-generate``: exits with the code of :func:`run`."""
    try:
        code = run(argv)
    except KeyboardInterrupt:
        if _rank() == 0:
            print(f"{_PROG}: stopped by SIGINT (Ctrl-C)", file=sys.stderr, flush=True)
        sys.exit(EXIT_INTERRUPTED)
    except Exception as exc:
        if not raised_as(exc, [_GENERATION_ERROR, *USER_ERROR_TYPES]):
            raise
        if _rank() == 0:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            print(f"{_PROG}: error: {first}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG_ERROR)
    sys.exit(code)
