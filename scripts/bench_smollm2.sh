#!/usr/bin/env bash
# The README's speculative-decoding table: SmolLM2-135M-Instruct with the shipped heads, greedy, batch 1,
# the first 20 prompts (the eval rows, never trained on) of each shared prompt set, 256 new tokens.
set -euo pipefail
cd "$(dirname "$0")/.."
ART=${ART:-art/smollm2-b1}
[ -f "$ART/manifest.json" ] || specrt export smollm2 --out "$ART" --batch 1 --force >&2
specrt bench "$ART" --prompts datasets/gsm8k.jsonl --prompts datasets/humaneval.jsonl \
    --prompts datasets/math500.jsonl --prompts datasets/mbpp.jsonl --prompts datasets/mt-bench.jsonl \
    --limit 20 --max-new-tokens 256 --methods ar,mtp,dspark --plot docs/bench_smollm2.png "$@"
# measured: `time scripts/bench_smollm2.sh --json > docs/bench_smollm2.json` (38 min on 2 cores)
