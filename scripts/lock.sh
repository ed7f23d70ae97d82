#!/usr/bin/env bash
# Regenerate requirements/*.lock from pyproject.toml's ranges, pinned to the versions installed in the current
# environment (the ones the suite just passed with): uv pip compile with them as constraints.
#   . .venv/bin/activate && pip install uv && scripts/lock.sh
set -euo pipefail
cd "$(dirname "$0")/.."
tested=$(mktemp) && trap 'rm -f "$tested" "$tested.np1"' EXIT
pip freeze | grep -v '^-e \|^specrt\| @ file://' | sed 's/+cpu$//' > "$tested"
grep -v '^numpy==' "$tested" > "$tested.np1"  # the Triton environment resolves its own numpy (< 2)
compile() {  # OUT CONSTRAINTS EXTRAS...
    local out=$1 constraints=$2; shift 2
    local head; head=$(sed -n '/^#/p' "$out" 2>/dev/null || true)
    uv pip compile pyproject.toml "${@/#/--extra=}" -c "$constraints" --find-links /opt/wheels --python-version 3.11 \
        --python-platform x86_64-manylinux_2_36 --no-header --annotation-style line -q -o "$out.new"
    sed -i -e "s#, -c $constraints##; s#-c $constraints, ##; s#  *\# via -c $constraints\$##; s/+cpu / /" "$out.new"
    { printf '%s\n' "$head"; grep -v '^#' "$out.new"; } > "$out" && rm "$out.new"
}
compile requirements/ci.lock "$tested" cpu test
compile requirements/triton-server.lock "$tested.np1" cpu triton-server
