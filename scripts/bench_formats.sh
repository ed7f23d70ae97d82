#!/usr/bin/env bash
# The README's weight-format table: SmolLM2-135M-Instruct exported in every weight format, each benchmarked
# (`ar`, greedy, batch 1, 2 threads, the first 5 prompts of each shared set, 128 new tokens) side by side with
# llama.cpp on the same GGUF in the same run, then compared with transformers' fp32 dequantization of that GGUF
# (`specrt parity`). llama.cpp needs the optional extra: pip install 'specrt[llama]'. Each engine runs in its own
# process, interleaved prompt by prompt over two passes (see the README's "Measurement").
# Writes docs/formats/{bench,parity}_<format>.json; PARITY=0 skips the parity runs (their numerics do not change
# between runs of the same artifact).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p docs/formats
SETS=(--prompts datasets/gsm8k.jsonl --prompts datasets/humaneval.jsonl --prompts datasets/math500.jsonl
      --prompts datasets/mbpp.jsonl --prompts datasets/mt-bench.jsonl)
for FORMAT in ${FORMATS:-gguf int4 int8 float}; do
    ART=art/smollm2-$FORMAT
    [ -f "$ART/manifest.json" ] || specrt export smollm2 --out "$ART" --weights "$FORMAT" --attention cpu \
        --batch 1 --force --quiet >&2
    specrt bench "$ART" "${SETS[@]}" --limit 5 --max-new-tokens 128 --methods ar --baseline llama.cpp \
        --repeats 2 --threads 2 --json > "docs/formats/bench_$FORMAT.json"
    [ "${PARITY:-1}" = 0 ] && continue
    specrt parity "$ART" "${SETS[@]}" --limit 5 --max-new-tokens 64 --threads 2 --json \
        > "docs/formats/parity_$FORMAT.json"
done
[ "${PARITY:-1}" = 0 ] && exit 0
# gguf with fp32 activations (MatMulNBits accuracy level 0): numerics only (its 8-bit LM head has no fast path
# in ONNX Runtime, ~0.4 s a token), so parity on the first prompt of each set
ART=art/smollm2-gguf-acc0
[ -f "$ART/manifest.json" ] || specrt export smollm2 --out "$ART" --weights gguf --accuracy-level 0 \
    --attention cpu --batch 1 --no-heads --force --quiet >&2
specrt parity "$ART" "${SETS[@]}" --limit 1 --max-new-tokens 64 --threads 2 --json > docs/formats/parity_gguf-acc0.json
