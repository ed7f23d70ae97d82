"""The draft sampling rule as ONNX (the "draft graphs" comment in specrt/artifact.py), emitted by one function.

    logits[...,V] ─Cast f32─┬─ Div(T) ─ Softmax ───────────────────────────────────────────────► probs[...,V]
                            │            └─ CumSum ─ LessOrEqual(noise · cdf[-1]) ─ count ─ Min(V-1) ─┐
                            └─ ArgMax (first max) ─────────────────────────────────────── Where(T > 0) ─► token[...]

T = temperature where it is > 0, else 1 (probs stay a proper distribution for greedy slots too). The noise
is an input (uniform [0,1)), so the graph is deterministic and the runtime can replay every draw.
"""
from __future__ import annotations

import numpy as np

from specrt.exporter.onnx.builder import GraphBuilder, onnx_dtype

F32, I64 = onnx_dtype("float32"), onnx_dtype("int64")


def sample_draft(g: GraphBuilder, logits: str, temperature: str, noise: str, vocab: int, dtype: str
                 ) -> tuple[str, str]:
    """(token [...] i64, probs [..., V] f32) for logits [..., V]; temperature f32 and noise f32 are [..., 1].

    probs = softmax(logits / T); token = min(#(cdf <= noise * cdf[-1]), V-1) if temperature > 0, else the
    first argmax of the logits.
    """
    with g.scope("sample"):
        lf = g.op("Cast", logits, to=F32) if dtype != "float32" else logits
        hot = g.op("Greater", temperature, g.const(np.float32(0.0), "zero"))
        t = g.op("Where", hot, temperature, g.const(np.float32(1.0), "one"))
        probs = g.op("Softmax", g.op("Div", lf, t), axis=-1, name="probs")
        greedy = g.op("ArgMax", lf, axis=-1, keepdims=1, select_last_index=0, name="greedy")  # first max
        cdf = g.op("CumSum", probs, g.const(np.int64(-1), "axis"), name="cdf")  # TensorRT: axis as initializer
        total = g.op("Slice", cdf, g.const([-1], "last", "int64"), g.const([vocab], "end", "int64"),
                     g.const([-1], "axes", "int64"), name="total")  # cdf[-1], ~1 up to rounding
        below = g.op("LessOrEqual", cdf, g.op("Mul", noise, total, name="threshold"))
        # the count as a float sum: exact up to 2^24 tokens, and TensorRT reduces floats natively
        count = g.op("ReduceSum", g.op("Cast", below, to=F32), g.const([-1], "axes", "int64"), keepdims=1)
        sampled = g.op("Min", g.op("Cast", count, to=I64), g.const([vocab - 1], "last_id", "int64"))
        token = g.op("Where", hot, sampled, greedy, name="token")
        return g.op("Squeeze", token, g.const([-1], "axes", "int64")), probs


def greedy_draft(g: GraphBuilder, logits: str, dtype: str) -> str:
    """token [...] i64: the first argmax of logits [..., V], as `sample_draft` picks at temperature 0 (a greedy
    variant's whole sampling rule)."""
    with g.scope("sample"):
        lf = g.op("Cast", logits, to=F32) if dtype != "float32" else logits
        return g.op("ArgMax", lf, axis=-1, keepdims=0, select_last_index=0, name="greedy")
