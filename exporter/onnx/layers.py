"""ONNX emitters for the pieces of a decoder layer (RMSNorm, linear, rope, cached attention, MLP).

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


def rms_norm(g: GraphBuilder, x: str, weight: str, eps: float, dtype: str, name: str = "norm") -> str:
    """y = x / sqrt(mean(x^2) + eps) * w, computed in fp32 (ORT fuses this into SimplifiedLayerNorm)."""
    with g.scope(name):
        xf = g.op("Cast", x, to=onnx_dtype("float32")) if dtype != "float32" else x
        sq = g.op("Mul", xf, xf, name="square")
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


def apply_rope(g: GraphBuilder, x: str, cos: str, sin: str, head_dim: int, name: str) -> str:
    """x*cos + rotate_half(x)*sin with rotate_half(x) = [-x2, x1] over the last axis."""
    with g.scope(name):
        half = head_dim // 2
        x1 = g.op("Slice", x, g.const([0], "start", "int64"), g.const([half], "mid", "int64"),
                  g.const([-1], "axis", "int64"))
        x2 = g.op("Slice", x, g.const([half], "mid", "int64"), g.const([head_dim], "end", "int64"),
                  g.const([-1], "axis", "int64"))
        rotated = g.op("Concat", g.op("Neg", x2), x1, axis=-1)
        return g.op("Add", g.op("Mul", x, cos), g.op("Mul", rotated, sin))


def heads(g: GraphBuilder, x: str, shapes: Shapes, n_heads: int, head_dim: int, name: str) -> str:
    """[N, n*D] -> [B, T, n, D]."""
    shape = g.op("Concat", shapes.batch, shapes.tokens, g.const([n_heads, head_dim], "heads", "int64"),
                 axis=0, name=f"{name}_shape")
    return g.op("Reshape", x, shape, name=name)


def mlp(g: GraphBuilder, x: str, prefix: str) -> str:
    """down(silu(gate(x)) * up(x))."""
    with g.scope("mlp"):
        gate = linear(g, x, g.weight(f"{prefix}.gate_proj.weight"), name="gate_proj")
        up = linear(g, x, g.weight(f"{prefix}.up_proj.weight"), name="up_proj")
        act = g.op("Mul", gate, g.op("Sigmoid", gate), name="silu")
        return linear(g, g.op("Mul", act, up), g.weight(f"{prefix}.down_proj.weight"), name="down_proj")
