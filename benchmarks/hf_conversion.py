"""Hugging Face import/export throughput and peak memory against safetensors alone.

Two families, each written as a two-shard safetensors checkpoint: a Llama-style model
(grouped-query attention, SwiGLU, untied embeddings; about 103 M parameters, 412 MB of fp32
at the default size, 12.6 times its largest tensor, the 33 MB embedding) and a Qwen3-MoE
model of the same hidden size (``--experts`` routed SwiGLU experts of ``hidden / 2`` per
layer, QK-norm; half the layers, so a few hundred small expert tensors beside the
embeddings). Each measurement runs in a
fresh process of its own, so its peak resident memory is its own; the conversions first
convert a tiny model in that process, so module imports are neither timed nor counted:

* baseline read: ``safe_open`` + ``get_tensor`` of every tensor, copied into memory (what
  any loader must do);
* baseline write: ``safetensors.torch.save_file`` of the same tensors, flushed with ``fsync``
  (as the checkpoint save and, here, the export are);
* import: ``bridge.train.convert.import_hf_checkpoint`` (read, re-layout, and a
  ``torch_dist`` save through ``save_checkpoint``, each parameter produced when it is
  written);
* export: ``bridge.train.convert.export_hf_checkpoint`` (``load_checkpoint``, re-layout,
  safetensors write).

For each it prints GB/s (model bytes / seconds of the operation, process start and imports
excluded), the ratio to the matching baseline, and the peak resident memory the operation
added (anonymous resident memory, ``RssAnon``, sampled every millisecond, minus its value
just before the operation; memory-mapped file pages are page cache and not counted) as a
multiple of the largest tensor and of the whole model. It asserts nothing. Run from the repository root::

    uv run python benchmarks/hf_conversion.py [--family all|llama|qwen3_moe] [--hidden 1024]
        [--layers 8] [--experts 8] [--dir /tmp/hfb] [--malloc-mmap-threshold 1048576]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def _anon_bytes() -> int:
    """Anonymous resident memory (RssAnon): tensors and heap, not memory-mapped files.

    safetensors memory-maps its files, and mapped pages count in plain RSS although they
    are page cache the kernel can drop; RssAnon counts what the process really holds.
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


class _PeakSampler:
    """The highest RssAnon seen, sampled every millisecond on a thread."""

    def __init__(self) -> None:
        self.peak = _anon_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _anon_bytes())

    def __enter__(self) -> _PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _anon_bytes())


def _write_model(
    directory: Path, hidden: int, layers: int, vocab: int, family: str = "llama", experts: int = 8
) -> dict[str, Any]:
    import torch
    from safetensors.torch import save_file

    heads, kv_heads = hidden // 64, max(1, hidden // 256)
    ffn = int(hidden * 8 / 3) // 64 * 64
    config: dict[str, Any] = {
        "model_type": family,
        "architectures": ["LlamaForCausalLM" if family == "llama" else "Qwen3MoeForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }
    if family == "qwen3_moe":
        config.update(
            head_dim=hidden // heads,
            num_experts=experts,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden // 2,
            norm_topk_prob=True,
        )
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    d = hidden // heads
    shards: list[dict[str, torch.Tensor]] = [
        {"model.embed_tokens.weight": rand(vocab, hidden)},
        {"lm_head.weight": rand(vocab, hidden), "model.norm.weight": torch.ones(hidden)},
    ]
    for i in range(layers):
        p = f"model.layers.{i}."
        layer = {
            f"{p}input_layernorm.weight": torch.ones(hidden),
            f"{p}post_attention_layernorm.weight": torch.ones(hidden),
            f"{p}self_attn.q_proj.weight": rand(heads * d, hidden),
            f"{p}self_attn.k_proj.weight": rand(kv_heads * d, hidden),
            f"{p}self_attn.v_proj.weight": rand(kv_heads * d, hidden),
            f"{p}self_attn.o_proj.weight": rand(hidden, heads * d),
        }
        if family == "llama":
            layer |= {
                f"{p}mlp.gate_proj.weight": rand(ffn, hidden),
                f"{p}mlp.up_proj.weight": rand(ffn, hidden),
                f"{p}mlp.down_proj.weight": rand(hidden, ffn),
            }
        else:
            layer |= {
                f"{p}self_attn.q_norm.weight": torch.ones(d),
                f"{p}self_attn.k_norm.weight": torch.ones(d),
                f"{p}mlp.gate.weight": rand(experts, hidden),
            }
            for e in range(experts):
                x = f"{p}mlp.experts.{e}."
                layer |= {
                    f"{x}gate_proj.weight": rand(hidden // 2, hidden),
                    f"{x}up_proj.weight": rand(hidden // 2, hidden),
                    f"{x}down_proj.weight": rand(hidden, hidden // 2),
                }
        shards[i * 2 // layers].update(layer)
    weight_map: dict[str, str] = {}
    total = largest = 0
    for index, shard in enumerate(shards):
        name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        for key, tensor in shard.items():
            weight_map[key] = name
            size = tensor.numel() * tensor.element_size()
            total += size
            largest = max(largest, size)
    index_file = directory / "model.safetensors.index.json"
    index_file.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return {"total_bytes": total, "largest_bytes": largest}


def _fsync_files(directory: Path) -> None:
    """Flush every file of ``directory`` to disk (not the whole system's dirty pages)."""
    for file in directory.iterdir():
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _child(op: str, src: str, dst: str) -> dict[str, float]:
    """One measured operation in this (fresh) process."""
    if op in ("import", "export"):
        import bridge.train.convert as convert

        family = json.loads(
            (Path(src if op == "import" else f"{src}/hf") / "config.json").read_text()
        )["model_type"]
        # Convert a tiny model first: every module the conversion imports is loaded (and
        # its code resident) before the baseline, so time and memory are the conversion's.
        with tempfile.TemporaryDirectory(prefix="hf-bench-warm-up-") as warm:
            _write_model(Path(warm) / "hf", hidden=64, layers=2, vocab=256, family=family)
            convert.import_hf_checkpoint(Path(warm) / "hf", Path(warm) / "ckpt")
            convert.export_hf_checkpoint(Path(warm) / "ckpt", Path(warm) / "out")
    else:
        import safetensors.torch  # noqa: F401
    before = _anon_bytes()
    started = time.perf_counter()
    sampler = _PeakSampler().__enter__()
    if op == "read":
        from safetensors import safe_open

        index = json.loads((Path(src) / "model.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        for file in files:
            with safe_open(str(Path(src) / file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118
                    # get_tensor may return a view of the memory map: copy it into memory,
                    # as loading into a model does.
                    tensor = handle.get_tensor(name).clone()
                    del tensor
    elif op == "write":
        from safetensors import safe_open
        from safetensors.torch import save_file

        # Read outside the timer (like export, which loads its checkpoint first), then write.
        index = json.loads((Path(src) / "model.safetensors.index.json").read_text())
        by_file: dict[str, dict[str, Any]] = {}
        for file in index["weight_map"].values():
            by_file.setdefault(file, {})
        for file, tensors in by_file.items():
            with safe_open(str(Path(src) / file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118
                    tensors[name] = handle.get_tensor(name).clone()
        sampler.__exit__()
        before = _anon_bytes()
        started = time.perf_counter()
        sampler = _PeakSampler().__enter__()
        Path(dst).mkdir()
        for file, tensors in by_file.items():
            save_file(tensors, str(Path(dst) / file), metadata={"format": "pt"})
        _fsync_files(Path(dst))
    elif op == "import":
        convert.import_hf_checkpoint(src, dst)
    elif op == "export":
        convert.export_hf_checkpoint(src, dst, max_shard_bytes=256 * 1024**2)
        _fsync_files(Path(dst))  # the import's save_checkpoint flushes its files too
    seconds = time.perf_counter() - started
    sampler.__exit__()
    return {"seconds": seconds, "peak_added_bytes": max(0, sampler.peak - before)}


def _run(op: str, src: Path, dst: Path, mmap_threshold: int | None) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    if mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    result = subprocess.run(
        [sys.executable, __file__, "--child", op, str(src), str(dst)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{op} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=["all", "llama", "qwen3_moe"], default="all")
    parser.add_argument("--experts", type=int, default=8, help="experts per layer (qwen3_moe)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=None,
        metavar="BYTES",
        help="run each measurement with glibc's MALLOC_MMAP_THRESHOLD_=BYTES (a fixed "
        "threshold: freed tensors leave the resident memory, so the peak is what the "
        "operation holds, not what the allocator kept)",
    )
    parser.add_argument("--child", nargs=3, metavar=("OP", "SRC", "DST"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(*args.child)))
        return
    families = ["llama", "qwen3_moe"] if args.family == "all" else [args.family]
    root = Path(args.dir or tempfile.mkdtemp(prefix="hf-bench-"))
    if root.exists():
        shutil.rmtree(root)
    try:
        for family in families:
            _measure(root / family, family, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _measure(root: Path, family: str, args: argparse.Namespace) -> None:
    """Write one family's model, run the four measurements, print the table."""
    layers = args.layers if family == "llama" else max(2, args.layers // 2)
    sizes = _write_model(root / "hf", args.hidden, layers, args.vocab, family, args.experts)
    total, largest = sizes["total_bytes"], sizes["largest_bytes"]
    print(
        f"{family}: {total / 1e6:.0f} MB fp32, largest tensor {largest / 1e6:.0f} MB "
        f"(hidden {args.hidden}, {layers} layers, vocabulary {args.vocab}"
        + (f", {args.experts} experts per layer)" if family != "llama" else ")")
    )
    threshold = args.malloc_mmap_threshold
    results = {
        "safetensors read": _run("read", root / "hf", root / "unused", threshold),
        "safetensors write": _run("write", root / "hf", root / "rewritten", threshold),
        "import": _run("import", root / "hf", root / "ckpt", threshold),
        "export": _run("export", root / "ckpt", root / "exported", threshold),
    }
    # A conversion reads one format and writes the other: its baseline is both.
    base_seconds = results["safetensors read"]["seconds"] + results["safetensors write"]["seconds"]
    print(
        f"{'operation':<18} {'seconds':>8} {'GB/s':>7} {'vs base':>8} {'peak/largest':>13} {'peak/model':>11}"
    )
    for name, r in results.items():
        rate = total / r["seconds"] / 1e9
        ratio = f"{base_seconds / r['seconds']:.2f}x" if name in ("import", "export") else "-"
        print(
            f"{name:<18} {r['seconds']:>8.2f} {rate:>7.3f} {ratio:>8} "
            f"{r['peak_added_bytes'] / largest:>13.1f} {r['peak_added_bytes'] / total:>11.2f}"
        )
    print(
        "vs base: (safetensors read + write time) / conversion time; peak: anonymous "
        "resident memory added by the operation"
    )


if __name__ == "__main__":
    main()
