#!/usr/bin/env bash
# Reproduces the committed SmolLM2-135M-Instruct heads in specrt/heads/smollm2/ on a 2-core CPU.
# Training prompts: every shared dataset row after the first 20 (the eval rows benchmarks report on),
# 720 of them spread evenly over the five files; the first 20 rows of each file are never trained on.
# Both commands share one work directory, so the second reuses the first's generation and features.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-work/distill-smollm2}
PROMPTS=(--prompts datasets/gsm8k.jsonl --prompts datasets/humaneval.jsonl --prompts datasets/math500.jsonl
         --prompts datasets/mbpp.jsonl --prompts datasets/mt-bench.jsonl)
# --weights float: the committed heads were distilled on the GGUF's fp32 dequantization (the default became the
# preset's served 4-bit format later)
COMMON=(--limit 720 --max-new-tokens 256 --sampling greedy --weights float --work "$WORK" --force)
specrt distill smollm2 --head dspark --layers 1 --block 7 --markov-rank 64 --steps 2500 \
    "${PROMPTS[@]}" "${COMMON[@]}" --out specrt/heads/smollm2/dspark
specrt distill smollm2 --head mtp --layers 1 --steps 2000 \
    "${PROMPTS[@]}" "${COMMON[@]}" --out specrt/heads/smollm2/mtp
