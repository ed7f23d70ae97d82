#!/usr/bin/env bash
# A draft head for your model on one GPU, end to end: `specrt distill --device cuda` generates the target's own
# responses (the torch backend, CUDA graphs, GEN_BATCH requests in flight), captures its features, trains the head on
# the GPU, calibrates its confidences and saves it. Meant to take about ten minutes for a model of SmolLM2-135M's size
# on one H100 (not yet timed on a GPU: `tests/gpu/run.sh --parts distill` times it; the run prints its estimate
# after exporting the work target, and each stage resumes if interrupted).
#
#   scripts/distill_gpu.sh MODEL OUT [more `specrt distill` flags]
#
# MODEL: a GGUF file, a Hugging Face directory or a preset name; OUT: the head's directory (then
# `specrt export MODEL --draft OUT`). Environment: HEAD (dspark | mtp; default dspark), LIMIT (prompts; default 2000),
# STEPS (default 3000), GEN_BATCH (default 64), DEVICE (default cuda), WORK (default OUT.work).
# Prompts: the corpus prompt sets (code, chat; datasets/corpus/README.md gives their sources and licences) and the
# spare rows of the eval sets (their eval rows are never trained on).
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
model=$1 out=$2
shift 2
root=$(cd "$(dirname "$0")/.." && pwd)
prompts=()
for f in corpus/stdlib.jsonl.gz corpus/numpy.jsonl.gz corpus/careers.jsonl.gz corpus/world.jsonl.gz \
         humaneval.jsonl mbpp.jsonl gsm8k.jsonl math500.jsonl mt-bench.jsonl; do
    prompts+=(--prompts "$root/datasets/$f")
done
exec python3 -m specrt.cli distill "$model" --head "${HEAD:-dspark}" --device "${DEVICE:-cuda}" "${prompts[@]}" \
    --limit "${LIMIT:-2000}" --steps "${STEPS:-3000}" --gen-batch "${GEN_BATCH:-64}" --out "$out" \
    --work "${WORK:-$out.work}" "$@"
