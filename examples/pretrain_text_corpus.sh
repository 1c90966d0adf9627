#!/usr/bin/env bash
# Pretrain a small GPT on a local text corpus, end to end, on CPU.
#
#   examples/pretrain_text_corpus.sh [corpus.txt|corpus.jsonl] [extra overrides ...]
#
# 1. tokenizes the corpus (default: the shipped examples/data/tiny_corpus.txt, one story
#    per line) into megatron's .bin/.idx format with the byte-level tokenizer;
# 2. trains examples/recipes/gpt_text_corpus.yaml on it: checkpoints in
#    runs/gpt_text_corpus (runs/gpt_text_corpus_<corpus name> for another corpus, so a new
#    corpus starts a new run), TensorBoard events next to them (..._tb).
# Run it again to resume; NPROC=2 trains with two data-parallel processes. Outside an
# activated virtual environment the commands run through `uv run`.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
corpus="$here/data/tiny_corpus.txt"
# The first argument is the corpus unless it is an override (a=b) or an option (--x).
if [[ $# -gt 0 && "$1" != *=* && "$1" != -* ]]; then
    corpus="$1"
    shift
fi
name="$(basename "${corpus%.*}")"
prefix="data/$name"

run=()
command -v bridge-train >/dev/null 2>&1 || run=(uv run)

if [[ ! -f "$prefix.bin" ]]; then
    split=()
    [[ "$corpus" == *.jsonl || "$corpus" == *.json ]] || split=(--split-lines)
    "${run[@]}" bridge-preprocess-data --input "$corpus" "${split[@]}" --output-prefix "$prefix"
fi

# Each corpus trains in a directory of its own: resuming another corpus's run would
# continue it on this data at the end of its learning-rate schedule (bridge-train refuses
# that). Overrides given on the command line win.
outputs=()
if [[ "$corpus" != "$here/data/tiny_corpus.txt" ]]; then
    [[ " $* " == *" checkpoint.save="* ]] || outputs+=("checkpoint.save=runs/gpt_text_corpus_$name")
    [[ " $* " == *" logger.tensorboard_dir="* ]] ||
        outputs+=("logger.tensorboard_dir=runs/gpt_text_corpus_${name}_tb")
fi

nproc="${NPROC:-1}"
if [[ "$nproc" == 1 ]]; then
    launch=(bridge-train)
else
    launch=(torchrun --nproc_per_node="$nproc" -m bridge.train)
fi
"${run[@]}" "${launch[@]}" --config "$here/recipes/gpt_text_corpus.yaml" \
    "dataset.blend=[[$prefix],null]" "${outputs[@]}" "$@"
