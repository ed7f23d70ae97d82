#!/usr/bin/env bash
# The GPU check (tests/gpu/check.py): one table of correctness checks and timings, in under 8 minutes on an H200.
# Needs nothing beyond the checkout on a machine whose python3 has torch with CUDA, triton, transformers, onnx and
# onnxruntime (the GPU test machine has them); specrt is installed from the checkout without its pins. SmolLM2 rows need the GGUF
# (SmolLM2-135M-Instruct.Q4_1.gguf, 98 MB) and the `gguf` package:
#   SMOLLM2=path/to/the.gguf   or the file in $SPECRT_CACHE (default ~/.cache/specrt)
#   GGUF_WHEEL=path/to/gguf-*.whl   installed with --no-deps when `import gguf` fails
# Writes the table to stdout and, as JSON, to $OUT/gpu_check.json when OUT is set.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
site=$(mktemp -d)
python3 -m pip install -q --no-deps --no-index --no-build-isolation --target "$site" . >/dev/null \
    || { echo "cannot install specrt from the checkout"; exit 2; }
if ! python3 -c "import gguf" 2>/dev/null && [ -n "${GGUF_WHEEL:-}" ]; then
    python3 -m pip install -q --no-deps --no-index --target "$site" "$GGUF_WHEEL" >/dev/null
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
args=(--device "${DEVICE:-cuda}")
[ -n "${SMOLLM2:-}" ] && args+=(--smollm2 "$SMOLLM2")
[ -n "${OUT:-}" ] && args+=(--out "$OUT/gpu_check.json")
timeout "${LIMIT:-470}" python3 tests/gpu/check.py "${args[@]}" "$@"
