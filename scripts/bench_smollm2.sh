#!/usr/bin/env bash
# The README's speculative-decoding table: SmolLM2-135M-Instruct with the shipped heads in the preset's
# default format (its GGUF blocks, cpu lowering), greedy, batch 1, 2 threads, the first 20 prompts (the eval
# rows, never trained on) of each shared prompt set, 256 new tokens; llama.cpp on the same GGUF beside it
# when llama-cpp-python is installed (pip install 'specrt[llama]').
set -euo pipefail
cd "$(dirname "$0")/.."
ART=${ART:-art/smollm2-gguf-b1}
[ -f "$ART/manifest.json" ] || specrt export smollm2 --out "$ART" --batch 1 --force >&2
BASELINE=()
python -c "import llama_cpp" 2>/dev/null && BASELINE=(--baseline llama.cpp)
specrt bench "$ART" --prompts datasets/gsm8k.jsonl --prompts datasets/humaneval.jsonl \
    --prompts datasets/math500.jsonl --prompts datasets/mbpp.jsonl --prompts datasets/mt-bench.jsonl \
    --limit 20 --max-new-tokens 256 --methods ar,ngram,mtp,dspark --threads 2 "${BASELINE[@]}" \
    --plot docs/bench_smollm2.png "$@"
# measured: `time scripts/bench_smollm2.sh --json > docs/bench_smollm2.json` (38 min on 2 cores)
