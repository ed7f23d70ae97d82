"""ONNX emitters for the pieces of a decoder layer (RMSNorm, linear, rope, MLP; attention is in attention.py).

Hidden states flow as 2-D [N = B*T, d] so every projection is one Gemm against the weight in its
Hugging Face [out, in] layout (transB=1): the weight file holds the checkpoint's tensors unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specrt.exporter.onnx.builder import GraphBuilder, onnx_dtype


@dataclass(frozen=True, slots=True)
class Shapes:
    """Shape tensors computed once per graph from the runtime shape of input_ids."""

    batch: str  # [1] i64
    tokens: str  # [1] i64
    qkv: str  # [4] i64: [B, T, H + 2*Hkv, D]


def rms_norm(g: GraphBuilder, x: str, weight: str, eps: float, dtype: str, name: str = "norm") -> str:
    """y = x / sqrt(mean(x^2) + eps) * w, computed in fp32 (ORT fuses this into SimplifiedLayerNorm)."""
    with g.scope(name):
        xf = g.op("Cast", x, to=onnx_dtype("float32")) if dtype != "float32" else x
        sq = g.op("Pow", xf, g.const(np.float32(2.0), "two"), name="square")
        var = g.op("ReduceMean", sq, g.const([-1], "axes", "int64"), keepdims=1)
        std = g.op("Sqrt", g.op("Add", var, g.const(eps, "eps", "float32")))
        y = g.op("Div", xf, std)
        if dtype != "float32":
            y = g.op("Cast", y, to=onnx_dtype(dtype))
        return g.op("Mul", y, weight, name="scale")


def linear(g: GraphBuilder, x: str, weight: str, bias: str | None = None, name: str = "linear") -> str:
    inputs = (x, weight, bias) if bias else (x, weight)
    return g.op("Gemm", *inputs, name=name, transB=1)


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
    """down(silu(gate(x)) * up(x)), with gate and up as one Gemm over the stacked weight."""
    with g.scope("mlp"):
        gate_up = linear(g, x, g.weight(f"{prefix}.gate_up_proj.weight"), name="gate_up_proj")
        gate, up = g.op("Split", gate_up, g.const([intermediate, intermediate], "sizes", "int64"), axis=-1,
                        outputs=2)
        act = g.op("Mul", gate, g.op("Sigmoid", gate), name="silu")
        return linear(g, g.op("Mul", act, up), g.weight(f"{prefix}.down_proj.weight"), name="down_proj")
