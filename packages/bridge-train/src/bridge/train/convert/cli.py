"""The ``bridge-convert`` command (also ``python -m bridge.train.convert``).

::

    bridge-convert import HF_DIR CKPT_DIR [--tp N] [--pp N] [--ep N]
                                          [--make-vocab-size-divisible-by N]
                                          [--seq-length N] [--quiet]
    bridge-convert export CKPT_DIR HF_DIR [--hf-config DIR] [--dtype {float32,bfloat16,float16}]
                                          [--max-shard-size GB] [--quiet]

Exit codes: 0 on success, 2 for an input that cannot be converted (one line on stderr:
unknown ``model_type``, missing shard, shape mismatch, tokenizer larger than the
embedding, existing output directory, ...), 1 for any other failure.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence

from bridge.config.notices import held_notices, print_held_notices

__all__ = ["EXIT_INPUT_ERROR", "build_parser", "main"]

EXIT_INPUT_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``bridge-convert``."""
    parser = argparse.ArgumentParser(
        prog="bridge-convert",
        description="Convert Hugging Face checkpoints to bridge-train checkpoints and back.",
    )
    sub = parser.add_subparsers(dest="direction", required=True)
    imp = sub.add_parser("import", help="Hugging Face model directory -> bridge-train checkpoint")
    imp.add_argument("hf_dir", help="local Hugging Face model directory (config.json, safetensors)")
    imp.add_argument("ckpt_dir", help="new checkpoint directory")
    imp.add_argument("--tp", type=int, default=1, help="tensor-parallel size to train with")
    imp.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to train with")
    imp.add_argument(
        "--ep", type=int, default=1, help="expert-parallel size to train with (MoE models)"
    )
    imp.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="vocabulary padding per tensor-parallel rank (default 128)",
    )
    imp.add_argument("--seq-length", type=int, default=None, help="training sequence length")
    exp = sub.add_parser("export", help="bridge-train checkpoint -> Hugging Face model directory")
    exp.add_argument("ckpt_dir", help="checkpoint directory (newest checkpoint) or iter_* dir")
    exp.add_argument("hf_dir", help="new output directory")
    exp.add_argument("--hf-config", default=None, help="directory with the HF config.json")
    exp.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    exp.add_argument("--max-shard-size", type=float, default=5.0, help="GB per shard")
    for direction in (imp, exp):
        direction.add_argument("--quiet", action="store_true", help="no per-tensor progress")
        direction.add_argument("--verbose", action="store_true", help=_VERBOSE_HELP)
    return parser


_VERBOSE_HELP = "print the notices of torch and megatron-core in full (default: one line)"
#: Loggers whose notices a conversion holds back: torch's import, megatron-core's model build.
_HELD_LOGGERS = ("torch.utils.cpp_extension", "megatron")


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``bridge-convert``; returns the exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    # torch's and megatron-core's import notices and megatron's "GPTModel IS DEPRECATED" say
    # nothing about a conversion: one line says they were held back (--verbose: in full).
    # A refused input is the one line the command prints (the notices do not matter then).
    with held_notices(_HELD_LOGGERS) as held:
        code, last_line = _convert(args)
    if code == 0:
        print_held_notices(
            held, "bridge-convert: ", verbose=args.verbose, how_to_see="--verbose prints them"
        )
    print(last_line, file=sys.stderr if code else sys.stdout, flush=True)
    return code


def _convert(args: argparse.Namespace) -> tuple[int, str]:
    """Run the conversion: ``(exit code, the line that ends the command)``."""

    def progress(message: str) -> None:
        if not args.quiet:
            print(f"bridge-convert: {message}", file=sys.stderr, flush=True)

    import torch

    from bridge.train.convert import AutoBridge, ConversionError

    started = time.monotonic()
    try:
        if args.direction == "import":
            out = AutoBridge.import_ckpt(
                args.hf_dir,
                args.ckpt_dir,
                tensor_model_parallel_size=args.tp,
                pipeline_model_parallel_size=args.pp,
                expert_model_parallel_size=args.ep,
                make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                seq_length=args.seq_length,
                progress=progress,
            )
        else:
            out = AutoBridge.export_ckpt(
                args.ckpt_dir,
                args.hf_dir,
                hf_config_dir=args.hf_config,
                dtype=getattr(torch, args.dtype) if args.dtype else None,
                max_shard_bytes=int(args.max_shard_size * 1024**3),
                progress=progress,
            )
    except ConversionError as exc:
        return EXIT_INPUT_ERROR, f"bridge-convert: error: {exc}"
    return 0, f"bridge-convert: {args.direction} done: {out} ({time.monotonic() - started:.1f} s)"
