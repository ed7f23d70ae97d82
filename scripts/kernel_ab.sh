#!/usr/bin/env bash
# Two builds of specrt's kernels paired in one process: a git revision's kernels/cpu (default HEAD) against the
# working tree's, on SmolLM2's weight shapes at M = 1, 2, 4, 8, 16 activation rows, then its attention (T = 1, 2, 3, 4,
# 8 query tokens over L = 136, 320, 900 keys, and 136 and 320 of a bias 256 and 512 keys wide, the rest masked: a cache
# allocated past the position; every task of a call as attention_plan cuts it), one thread, the best
# instruction set this CPU runs in each build ($SPECRT_OPS_ISA=avx2 or scalar asks for a lower one, in both; a base
# without AMX kernels runs AVX-512 VNNI where this tree runs AMX).
#
#     scripts/kernel_ab.sh [REV] [PAIRS]
#
# Per shape and M: the median over PAIRS (default 21) runs of this tree's time / the base's, each run timing both
# in turn (a machine whose speed drifts moves both), this tree's GMAC/s (attention: ns per query head and key), and
# "same" when both builds' outputs are the same bits ("DIFF": the change alters results, which a pure speed change
# must not). Compiled with the flags
# runtime/cpp/CMakeLists.txt gives libspecrt_ops; needs g++ and a CPU with AVX2. Run it on a quiet machine.
set -euo pipefail
rev=${1:-HEAD}
pairs=${2:-21}
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/base"
git -C "$root" archive "$rev" kernels/cpu | tar -x -C "$work/base" --strip-components=2
flags=(-O3 -std=c++17 -ffp-contract=off)
avx2=(-mavx2 -mfma -mf16c)
avx512=(-mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512vnni)
amx=("${avx512[@]}" -mamx-tile -mamx-int8)
build() {  # build TREE PREFIX [DEFINES...]: the kernels' translation units (the AMX one where the tree has it)
    local tree=$1 prefix=$2
    shift 2
    local defines=("$@")
    [ -f "$tree/gguf_amx.cpp" ] && defines+=(-DSPECRT_OPS_AMX)
    g++ "${flags[@]}" "${defines[@]}" -I"$tree" -c "$tree/gguf_kernels.cpp" -o "$work/$prefix-kernels.o"
    if [ -f "$tree/gguf_formats.cpp" ]; then
        g++ "${flags[@]}" "${defines[@]}" -I"$tree" -c "$tree/gguf_formats.cpp" -o "$work/$prefix-formats.o"
    fi
    g++ "${flags[@]}" "${avx2[@]}" "${defines[@]}" -I"$tree" -c "$tree/gguf_avx2.cpp" -o "$work/$prefix-avx2.o"
    g++ "${flags[@]}" "${avx512[@]}" "${defines[@]}" -I"$tree" -c "$tree/gguf_avx512.cpp" -o "$work/$prefix-avx512.o"
    if [ -f "$tree/gguf_amx.cpp" ]; then
        g++ "${flags[@]}" "${amx[@]}" "${defines[@]}" -I"$tree" -c "$tree/gguf_amx.cpp" -o "$work/$prefix-amx.o"
    fi
}
build "$work/base" base -Dspecrt=specrt_base
build "$root/kernels/cpu" ours
g++ "${flags[@]}" -I"$root/kernels/cpu" -I"$work" "$root/runtime/cpp/tools/kernel_ab.cpp" "$work"/*.o \
    -o "$work/kernel_ab"
echo "base: $rev ($(git -C "$root" rev-parse --short "$rev")); this tree: $root"
"$work/kernel_ab" "$pairs"
