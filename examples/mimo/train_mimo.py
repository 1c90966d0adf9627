"""Train a tiny vision-language MIMO model with heterogeneous parallelism on 4 ranks.

    uv run torchrun --nproc_per_node=4 examples/mimo/train_mimo.py
    uv run torchrun --nproc_per_node=4 examples/mimo/train_mimo.py --language-parallel dp

Ranks 0-1 run the vision encoder (a patch embedding and bidirectional megatron transformer
layers) with data parallelism 2; ranks 2-3 run a megatron GPT language model with tensor
parallelism 2 (or data parallelism 2 with ``--language-parallel dp``). The data are
synthetic image-caption pairs whose captions name the image's class, so the caption's class
tokens can only be predicted from the image: a loss below the text-only floor printed at the
start means the language model uses the encoder's embeddings. Runs on CPU (gloo) and GPU
(nccl). The cross-module data path is chosen automatically (megatron-core's
BridgeCommunicator on CUDA, torch.distributed point-to-point on CPU) and printed at the start;
``--communicator`` forces one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from bridge.config.notices import (
    held_notices,
    print_held_notices,
    silence_known_fallback_notices,
)

# torch's and megatron-core's import notices (Transformer Engine / Apex not installed, ...),
# once per rank, say nothing about this example: rank 0 prints one line about them.
with held_notices(("torch.utils.cpp_extension", "megatron")) as _IMPORT_NOTICES:
    import torch
    import torch.distributed as dist
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    import bridge.mimo as mimo


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument(
        "--language-parallel",
        choices=("tp", "dp"),
        default="tp",
        help="parallelism of the language model on ranks 2-3",
    )
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--communicator",
        choices=("auto", "p2p", "megatron"),
        default="auto",
        help="cross-module data path: auto picks megatron-core's BridgeCommunicator on CUDA "
        "when the layout fits it, else torch.distributed point-to-point (megatron needs CUDA)",
    )
    parser.add_argument(
        "--result-json", default=None, help="write the per-step losses to this file (rank 0)"
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="print the notices of torch and megatron-core in full (default: one line, rank 0)",
    )
    return parser.parse_args()


def build_layout(language_parallel: str) -> mimo.MimoLayout:
    """Vision encoder DP 2 on ranks 0-1; the language model on ranks 2-3 (TP 2 or DP 2)."""
    language = (
        mimo.ModulePlacement(ranks=range(2, 4), tp=2)
        if language_parallel == "tp"
        else mimo.ModulePlacement(ranks=range(2, 4), dp=2)
    )
    return mimo.MimoLayout(
        {"vision": mimo.ModulePlacement(ranks=range(0, 2), dp=2), "language": language}
    )


def build(args: argparse.Namespace) -> tuple[mimo.MegatronMIMOInfra, Any, Any, Any]:
    """The infra, model, optimizer and dataset of the example."""
    infra = mimo.build_megatron_mimo_infra(build_layout(args.language_parallel))
    config = mimo.TinyVLMConfig(vocab_size=32, seq_length=24)
    dataset = mimo.SyntheticImageCaptionDataset(
        4096,
        image_tokens=config.image_tokens,
        seq_length=config.seq_length,
        num_classes=8,
        image_size=config.image_size,
        channels=config.channels,
        seed=args.seed,
    )
    assert dataset.vocab_size <= config.vocab_size
    model = mimo.build_mimo_model(infra, init_seed=args.seed, **mimo.tiny_vlm_specs(config, infra))
    if torch.cuda.is_available():
        model.cuda()
    optimizer = mimo.build_multimodule_optimizer(
        model,
        infra,
        lambda name, params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01),
        clip_grad=1.0,
    )
    return infra, model, optimizer, dataset


def main() -> None:
    args = parse_args()
    if not args.verbose:  # megatron-core repeats some of them when the model is built
        silence_known_fallback_notices(cuda=torch.cuda.is_available())
    layout = build_layout(args.language_parallel)
    # Check the layout and the batch sizes before any process group or model exists, so a
    # bad launch fails at once with the module and sizes in the message.
    try:
        layout.validate(int(os.environ.get("WORLD_SIZE", "1")))
        layout.validate_batch_sizes(args.global_batch_size, args.micro_batch_size)
    except ValueError as exc:
        sys.exit(f"train_mimo.py: error: {exc}")

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    with held_notices(("megatron",)) as build_notices:
        infra, model, optimizer, dataset = build(args)
    if rank == 0:
        for line in build_notices.lines:
            _IMPORT_NOTICES.add(line)
        print_held_notices(
            _IMPORT_NOTICES,
            "train_mimo.py: ",
            verbose=args.verbose,
            how_to_see="--verbose prints them",
        )

    gbs = args.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.lr / 10,
        lr_warmup_steps=args.warmup_steps * gbs,
        lr_decay_steps=max(args.steps, args.warmup_steps + 1) * gbs,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=args.steps * gbs,
        wd_incr_style="constant",
    )
    step = mimo.MimoTrainStep(
        model,
        infra,
        optimizer,
        global_batch_size=gbs,
        micro_batch_size=args.micro_batch_size,
        communicator=args.communicator,
    )
    data = mimo.MimoDataLoader.for_infra(
        dataset,
        infra,
        global_batch_size=gbs,
        micro_batch_size=args.micro_batch_size,
        seed=args.seed,
    )

    if rank == 0:
        print(
            f"layout: {layout}\ncommunicator: {step.communicator_choice.describe()}\n"
            f"text-only loss floor (a model ignoring the images): "
            f"{dataset.text_only_loss_floor():.4f}",
            flush=True,
        )

    def log(record: mimo.MimoLogRecord) -> None:
        if rank == 0:
            print(record.format(), flush=True)

    result = mimo.train_mimo(
        step,
        data,
        train_iters=args.steps,
        scheduler=scheduler,
        log_fn=log,
        log_interval=args.log_interval,
    )
    if rank == 0:
        first = sum(result.losses[:5]) / len(result.losses[:5])
        last = sum(result.losses[-5:]) / len(result.losses[-5:])
        print(
            f"done: {result.iteration} steps, mean loss of the first 5 steps {first:.4f}, "
            f"of the last 5 steps {last:.4f}",
            flush=True,
        )
        if args.result_json:
            with open(args.result_json, "w") as handle:
                json.dump(
                    {
                        "losses": result.losses,
                        "text_only_floor": dataset.text_only_loss_floor(),
                        "skipped_iterations": result.skipped_iterations,
                    },
                    handle,
                )
    step.close()
    infra.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
