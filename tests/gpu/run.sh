#!/usr/bin/env bash
# The GPU check (tests/gpu/check.py): one table of correctness checks and timings, in under 8 minutes on an H200.
# Needs nothing beyond the checkout on a machine whose python3 has torch with CUDA, triton, transformers, onnx and
# onnxruntime (the GPU test machine has them); specrt is installed from the checkout without its pins. The GPU machine
# lacks array-api-compat and gguf (SmolLM2's rows read the GGUF with it) and has no package index:
#   WHEELS=folder   its wheels (array_api_compat-*.whl, gguf-*.whl; setuptools-*.whl >= 77, specrt's build backend,
#                   where the machine's is older) installed with --no-deps first
#   SMOLLM2=path/to/SmolLM2-135M-Instruct.Q4_1.gguf (98 MB)   or the file in $SPECRT_CACHE/models (default ~/.cache/specrt)
# Extra arguments go to check.py (--parts tiny,smollm2,tensorrt, --quick).
# Writes the table to stdout and, as JSON, to $OUT/gpu_check.json when OUT is set.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
site=$(mktemp -d)
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"  # a carried setuptools then builds specrt below
if [ -n "${WHEELS:-}" ]; then
    python3 -m pip install -q --no-deps --no-index --target "$site" "$WHEELS"/*.whl >/dev/null \
        || { echo "cannot install the wheels in $WHEELS"; exit 2; }
fi
# the GPU check runs no CPU kernels, and the machine cannot fetch their headers: a pure-Python build (setup.py)
SPECRT_NATIVE=off python3 -m pip install -q --no-deps --no-index --no-build-isolation --target "$site" . >/dev/null \
    || { echo "cannot install specrt from the checkout"; exit 2; }
args=(--device "${DEVICE:-cuda}")
[ -n "${SMOLLM2:-}" ] && args+=(--smollm2 "$SMOLLM2")
[ -n "${OUT:-}" ] && args+=(--out "$OUT/gpu_check.json")
timeout "${LIMIT:-470}" python3 tests/gpu/check.py "${args[@]}" "$@"
