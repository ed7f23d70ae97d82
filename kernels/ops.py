"""The ops of specrt's CPU kernel library (kernels/cpu, libspecrt_ops): what a node of each takes.

    MatMulGGUF       y[..., N] = x[..., K] @ W.T, W in GGUF blocks [N, K / 32 * block bytes] (uint8), optionally
                     SwiGLU over its two halves (activation "swiglu")
    GatherGGUF       rows of a table in GGUF blocks, dequantized
    RMSNorm          x / sqrt(mean(x^2) + epsilon) * w
    SkipRMSNorm      s = x + delta; (rms_norm(s), s)
    CacheAttention   attention of q over a slot's cache with an additive bias; optional `cells`: the packed rows
    PackedAttention  qkv projection's output in, (Qwen3's q/k norms,) rope, cache writes at the scattered cells,
                     attention, out: one node per layer (the packed verify's)

The exporter checks every node it emits against these (exporter/onnx/builder.py), the library registers the same
names (kernels/cpu/custom_ops.cpp), and specrt.native recognises a graph that needs the library by them.
"""
from __future__ import annotations

from dataclasses import dataclass

DOMAIN = "specrt"  # the ONNX domain of specrt's ops (also ConfidenceTruncate's, a local function, not a kernel)


@dataclass(frozen=True, slots=True)
class Schema:
    inputs: tuple[int, int]  # the fewest and most inputs
    outputs: int
    required: frozenset[str]  # attributes every node sets
    optional: frozenset[str] = frozenset()


SCHEMAS = {
    "MatMulGGUF": Schema((2, 2), 1, frozenset({"format", "K", "N"}), frozenset({"activation"})),
    "GatherGGUF": Schema((2, 2), 1, frozenset({"format", "K"})),
    "RMSNorm": Schema((2, 2), 1, frozenset({"epsilon"})),
    "SkipRMSNorm": Schema((3, 3), 2, frozenset({"epsilon"})),
    "CacheAttention": Schema((4, 5), 1, frozenset({"scale"})),
    "PackedAttention": Schema((8, 10), 3, frozenset({"scale", "heads", "kv_heads"}), frozenset({"epsilon"})),
}
KERNEL_OPS = tuple(SCHEMAS)  # the operators the library implements


def check(op_type: str, inputs: int, outputs: int, attributes: set[str]) -> None:
    """Raise ValueError where a node of `op_type` does not match its schema (an exporter bug, caught at export)."""
    s = SCHEMAS[op_type]
    problems = []
    if not s.inputs[0] <= inputs <= s.inputs[1]:
        problems.append(f"{inputs} inputs (takes {s.inputs[0]}..{s.inputs[1]})")
    if outputs != s.outputs:
        problems.append(f"{outputs} outputs (gives {s.outputs})")
    if s.required - attributes:
        problems.append(f"no {', '.join(sorted(s.required - attributes))}")
    if attributes - s.required - s.optional:
        problems.append(f"unknown {', '.join(sorted(attributes - s.required - s.optional))}")
    if problems:
        raise ValueError(f"specrt::{op_type} node with {'; '.join(problems)}")
