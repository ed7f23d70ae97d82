"""ONNX emitters for the pieces of a decoder layer (RMSNorm, linear, rope, MLP; attention is in attention.py).

Hidden states flow as 2-D [N = B*T, d] so every projection is one Gemm against the weight in its
Hugging Face [out, in] layout (transB=1): the weight file holds the checkpoint's tensors unchanged. With
quantized weights (`specrt export --weights`) a projection is one com.microsoft MatMulNBits over the blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specrt.exporter.onnx.builder import MS_DOMAIN, PLUGIN_DOMAIN, GraphBuilder, onnx_dtype
from specrt.blocks import BLOCK, GATHER_ROWS, gguf_key, gguf_parts, row_weights
from specrt.exporter.onnx.quant import is_quantized


@dataclass(frozen=True, slots=True)
class Shapes:
    """Shape tensors computed once per graph from the runtime shape of input_ids."""

    batch: str  # [1] i64
    tokens: str  # [1] i64
    qkv: str  # [4] i64: [B, T, H + 2*Hkv, D]


def rms_norm(g: GraphBuilder, x: str, weight: str, eps: float, dtype: str, name: str = "norm", *,
             lowering: str = "standard") -> str:
    """y = x / sqrt(mean(x^2) + eps) * w over the last axis, computed in fp32.

    `standard`: the decomposed form (ORT fuses it into SimplifiedLayerNorm); `cpu`: one RMSNormalization, or with
    `--kernels specrt` one specrt::RMSNorm (on the calling thread: ONNX Runtime's kernel spends more waking a second
    thread for a verify's few rows than the norm takes).
    """
    if lowering == "cpu" and _own_kernels(g, dtype):
        return g.op("RMSNorm", x, weight, name=name, domain=PLUGIN_DOMAIN, epsilon=float(eps))
    if lowering == "cpu":  # opset 23; ORT runs it with its SimplifiedLayerNormalization kernel
        return g.op("RMSNormalization", x, weight, name=name, axis=-1, epsilon=float(eps), stash_type=1)
    with g.scope(name):
        xf = g.op("Cast", x, to=onnx_dtype("float32")) if dtype != "float32" else x
        sq = g.op("Pow", xf, g.const(np.float32(2.0), "two"), name="square")
        var = g.op("ReduceMean", sq, g.const([-1], "axes", "int64"), keepdims=1)
        std = g.op("Sqrt", g.op("Add", var, g.const(eps, "eps", "float32")))
        y = g.op("Div", xf, std)
        if dtype != "float32":
            y = g.op("Cast", y, to=onnx_dtype(dtype))
        return g.op("Mul", y, weight, name="scale")


def add_rms_norm(g: GraphBuilder, x: str, delta: str, weight: str, eps: float, dtype: str, *, name: str,
                 residual: str, lowering: str = "standard") -> tuple[str, str]:
    """(x + delta, rms_norm(x + delta)): a residual add and the norm after it, for [N, d] hidden states.

    `cpu`: one com.microsoft SkipSimplifiedLayerNormalization (the sum is its fourth output), so the
    residual stream is read once, or with `--kernels specrt` one specrt::SkipRMSNorm (the sum its second output);
    `standard`: an Add named `residual`, then `rms_norm`.
    """
    if lowering == "cpu" and _own_kernels(g, dtype):
        normed, s = g.op("SkipRMSNorm", x, delta, weight, name=name, domain=PLUGIN_DOMAIN, outputs=2,
                         epsilon=float(eps))
        return s, normed
    if lowering != "cpu":
        s = g.op("Add", x, delta, name=residual)
        return s, rms_norm(g, s, weight, eps, dtype, name=name)
    normed, _, _, s = g.op("SkipSimplifiedLayerNormalization", x, delta, weight, name=name, domain=MS_DOMAIN,
                           outputs=4, epsilon=float(eps))
    return s, normed


def _own_kernels(g: GraphBuilder, dtype: str) -> bool:
    """Whether the graph runs on specrt's kernels (`--kernels specrt`), whose norms take float32."""
    return g.kernels == "specrt" and dtype == "float32"


def fuses_swiglu(g: GraphBuilder, weight: str) -> bool:
    """Whether `linear(..., activation="swiglu")` can be one node: a stacked gate/up weight in GGUF blocks of one
    type."""
    return gguf_key(g.store, weight) is not None


def linear(g: GraphBuilder, x: str, weight: str, bias: str | None = None, name: str = "linear", *,
           activation: str = "") -> str:
    """x [N, K] @ weightᵀ (+ bias): Gemm(transB=1) on a float weight, MatMulNBits on a block-quantized one,
    specrt::MatMulGGUF on a GGUF tensor's own bytes (one per part of a stack of several types, concatenated).
    `activation` "swiglu" (MatMulGGUF only, `fuses_swiglu`): silu of the first half of the product's columns times
    the second half, in the same node."""
    parts = gguf_parts(g.store, weight)
    if parts:
        if activation and len(parts) > 1:
            raise ValueError(f"{name}: activation {activation!r} needs a weight of one GGUF type")
        extra = {"activation": activation} if activation else {}
        ys = []
        for i, (key, fmt) in enumerate(parts):
            n, row = g.store.shape(key)
            ys.append(g.op("MatMulGGUF", x, g.weight(key), name=name if len(parts) == 1 else f"{name}/part{i}",
                           domain=PLUGIN_DOMAIN, format=fmt, K=row_weights(fmt, row), N=n, **extra))
        y = ys[0] if len(ys) == 1 else g.op("Concat", *ys, name=f"{name}/parts", axis=-1)
        return g.op("Add", y, bias, name=f"{name}_bias") if bias else y
    if activation:
        raise ValueError(f"{name}: activation {activation!r} needs a weight in GGUF blocks (specrt::MatMulGGUF)")
    if is_quantized(g.store, weight):
        return _linear_blocks(g, x, weight, bias, name)
    inputs = (x, weight, bias) if bias else (x, weight)
    return g.op("Gemm", *inputs, name=name, transB=1)


# x[N,K] ─ MatMulNBits(codes, scales[, zeros][, bias]) ─────────────────┐ C
#    └──── Reshape [N,K/32,32] ─ ReduceSum ─► blocksum(x)[N,K/32] ─ Gemm(·, minsᵀ) ─► y   (GGUF Q4_1 only)
def _linear_blocks(g: GraphBuilder, x: str, w: str, bias: str | None, name: str) -> str:
    """MatMulNBits over `w.q*` (see quant.py); Q4_1's w = d·q + m adds Σ_blocks sum(x_block)·m, exactly."""
    n, kb, blob = g.store.shape(w + ".qcodes")
    inputs = [x, g.weight(w + ".qcodes"), g.weight(w + ".qscales"),
              g.weight(w + ".qzeros") if w + ".qzeros" in g.store else ""]
    if bias:
        inputs += ["", bias]  # input 4, g_idx, is deprecated
    while not inputs[-1]:
        inputs.pop()
    level = {"accuracy_level": g.accuracy_level} if g.accuracy_level else {}  # 0: fp32 activations
    y = g.op("MatMulNBits", *inputs, name=name, domain=MS_DOMAIN, K=kb * BLOCK, N=n, bits=blob * 8 // BLOCK,
             block_size=BLOCK, **level)
    if w + ".qmins" not in g.store:
        return y
    with g.scope(name):
        sums = g.op("ReduceSum", g.op("Reshape", x, g.const([-1, kb, BLOCK], "blocks", "int64")),
                    g.const([-1], "axes", "int64"), keepdims=0, name="block_sums")
        return g.op("Gemm", sums, g.weight(w + ".qmins"), y, transB=1, name="mins")


def embedding(g: GraphBuilder, table: str, ids: str, name: str = "embed_tokens") -> str:
    """Rows of `table` [V, d] -> ids.shape + [d]: Gather, or GatherBlockQuantized on a block-quantized table.

    The quantized table is the same bytes as the tied LM head's MatMulNBits codes, named again as [V, d*bits/8];
    a table kept as GGUF bytes is read by specrt::GatherGGUF.
    """
    raw = gguf_key(g.store, table)
    if raw is not None:
        key, fmt = raw
        return g.op("GatherGGUF", g.weight(key), ids, name=name, domain=PLUGIN_DOMAIN, format=fmt,
                    K=row_weights(fmt, g.store.shape(key)[1]))
    if not is_quantized(g.store, table):
        return g.op("Gather", g.weight(table), ids, name=name)
    v, kb, blob = g.store.shape(table + ".qcodes")
    g.store.alias(table + GATHER_ROWS, table + ".qcodes", (v, kb * blob))
    inputs = [g.weight(table + GATHER_ROWS), ids, g.weight(table + ".qscales")]
    if table + ".qzeros" in g.store:
        inputs.append(g.weight(table + ".qzeros"))
    y = g.op("GatherBlockQuantized", *inputs, name=name, domain=MS_DOMAIN, bits=blob * 8 // BLOCK,
             block_size=BLOCK, gather_axis=0, quantize_axis=1)
    if table + ".qmins" not in g.store:
        return y
    with g.scope(name):  # GGUF Q4_1: + the row's min, broadcast over its block
        mins = g.op("Gather", g.weight(table + ".qmins"), ids, name="mins")  # ids.shape + [K/32]
        y = g.op("Add", g.op("Reshape", y, g.const([-1, kb, BLOCK], "blocks", "int64")),
                 g.op("Reshape", mins, g.const([-1, kb, 1], "per_block", "int64")), name="add_mins")
        return g.op("Reshape", y, g.op("Concat", g.op("Shape", ids), g.const([kb * BLOCK], "d", "int64"), axis=0))


def rope_tables(g: GraphBuilder, position_ids: str, inv_freq: list[float], dtype: str) -> tuple[str, str]:
    """cos/sin [B,T,1,D] for rotate-half rope (HF convention: the two halves share frequencies)."""
    with g.scope("rope"):
        freq = np.asarray(inv_freq + inv_freq, dtype=np.float32)  # [D]
        pos = g.op("Cast", g.op("Unsqueeze", position_ids, g.const([2, 3], "axes", "int64")),
                   to=onnx_dtype("float32"))  # [B,T,1,1]
        angles = g.op("Mul", pos, g.const(freq, "inv_freq"))  # [B,T,1,D]
        cos, sin = g.op("Cos", angles), g.op("Sin", angles)
        if dtype != "float32":
            cos = g.op("Cast", cos, to=onnx_dtype(dtype))
            sin = g.op("Cast", sin, to=onnx_dtype(dtype))
        return cos, sin


def rotate_half_matrix(head_dim: int, dtype: str) -> np.ndarray:
    """R with x @ R = [-x2, x1]: one MatMul instead of Slice/Slice/Neg/Concat (exact: one term per output)."""
    half = head_dim // 2
    r = np.zeros((head_dim, head_dim), dtype=dtype)
    r[np.arange(half) + half, np.arange(half)] = -1.0
    r[np.arange(half), np.arange(half) + half] = 1.0
    return r


def apply_rope(g: GraphBuilder, x: str, cos: str, sin: str, rotate: str, name: str) -> str:
    """x*cos + rotate_half(x)*sin over the last axis of [B,T,n,D]."""
    with g.scope(name):
        rotated = g.op("MatMul", x, rotate, name="rotate_half")
        return g.op("Add", g.op("Mul", x, cos), g.op("Mul", rotated, sin))


def mlp(g: GraphBuilder, x: str, prefix: str, intermediate: int) -> str:
    """down(silu(gate(x)) * up(x)), with gate and up as one Gemm over the stacked weight (on a GGUF weight, one
    specrt::MatMulGGUF that applies the SiLU and the product itself)."""
    with g.scope("mlp"):
        gate_up_w = g.weight(f"{prefix}.gate_up_proj.weight")
        if fuses_swiglu(g, gate_up_w):
            act = linear(g, x, gate_up_w, name="gate_up_proj", activation="swiglu")
            return linear(g, act, g.weight(f"{prefix}.down_proj.weight"), name="down_proj")
        gate_up = linear(g, x, gate_up_w, name="gate_up_proj")
        gate, up = g.op("Split", gate_up, g.const([intermediate, intermediate], "sizes", "int64"), axis=-1,
                        outputs=2)
        act = g.op("Mul", gate, g.op("Sigmoid", gate), name="silu")
        return linear(g, g.op("Mul", act, up), g.weight(f"{prefix}.down_proj.weight"), name="down_proj")
