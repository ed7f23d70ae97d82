"""Where specrt's ONNX Runtime kernels live: libspecrt_ops (runtime/cpp/ops), which graphs exported with
`specrt export --kernels specrt` need (their specrt::MatMulGGUF, GatherGGUF, RMSNorm, SkipRMSNorm, CacheAttention
and PackedAttention nodes).

Found at $SPECRT_OPS_LIB, else where the README's build puts it (build/cpp/libspecrt_ops.so in this checkout).
"""
from __future__ import annotations

import os
from pathlib import Path

from specrt.errors import SpecrtError

DOMAIN = "specrt"  # the ONNX domain of specrt's ops (also ConfidenceTruncate's, a local function, not a kernel)
# the operators the library implements
KERNEL_OPS = ("MatMulGGUF", "GatherGGUF", "RMSNorm", "SkipRMSNorm", "CacheAttention", "PackedAttention")
ENV = "SPECRT_OPS_LIB"
BUILD = ("scripts/cpp_deps.sh build/cpp-deps && cmake -S runtime/cpp -B build/cpp -DSPECRT_DEPS=build/cpp-deps && "
         "cmake --build build/cpp --target specrt_ops")


def ops_library(needed_by: str = "this artifact") -> Path:
    """The library's path, or a SpecrtError naming the fix."""
    given = os.environ.get(ENV)
    if given:
        path = Path(given)
        if not path.is_file():
            raise SpecrtError(f"${ENV} names {path}, which is not a file (libspecrt_ops.so)")
        return path
    path = Path(__file__).resolve().parents[1] / "build" / "cpp" / "libspecrt_ops.so"
    if path.is_file():
        return path
    raise SpecrtError(f"{needed_by} runs on specrt's CPU kernels (exported with --kernels specrt) and "
                      f"libspecrt_ops.so is not built: run `{BUILD}` in the specrt checkout, or set ${ENV}")


def uses_kernels(nodes) -> bool:
    """Whether a graph's nodes (onnx NodeProtos) include an operator of the library."""
    return any(n.domain == DOMAIN and n.op_type in KERNEL_OPS for n in nodes)


def available() -> bool:
    try:
        ops_library()
    except SpecrtError:
        return False
    return True
