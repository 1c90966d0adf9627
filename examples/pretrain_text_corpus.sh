#!/usr/bin/env bash
# Pretrain a small GPT on a local text corpus, end to end, on CPU.
#
#   examples/pretrain_text_corpus.sh [corpus.txt|corpus.jsonl] [extra overrides ...]
#
# 1. tokenizes the corpus (default: the shipped examples/data/tiny_corpus.txt, one story
#    per line) into megatron's .bin/.idx format with the byte-level tokenizer;
# 2. trains examples/recipes/gpt_text_corpus.yaml on it (checkpoints in
#    runs/gpt_text_corpus, TensorBoard events in runs/gpt_text_corpus_tb).
# Run it again to resume; NPROC=2 trains with two data-parallel processes.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
corpus="$here/data/tiny_corpus.txt"
# The first argument is the corpus unless it is an override (a=b) or an option (--x).
if [[ $# -gt 0 && "$1" != *=* && "$1" != -* ]]; then
    corpus="$1"
    shift
fi
prefix="data/$(basename "${corpus%.*}")"

if [[ ! -f "$prefix.bin" ]]; then
    split=()
    [[ "$corpus" == *.jsonl || "$corpus" == *.json ]] || split=(--split-lines)
    bridge-preprocess-data --input "$corpus" "${split[@]}" --output-prefix "$prefix"
fi

nproc="${NPROC:-1}"
if [[ "$nproc" == 1 ]]; then
    launch=(bridge-train)
else
    launch=(torchrun --nproc_per_node="$nproc" -m bridge.train)
fi
"${launch[@]}" --config "$here/recipes/gpt_text_corpus.yaml" \
    "dataset.blend=[[$prefix],null]" "$@"
