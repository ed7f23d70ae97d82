"""specrt::ConfidenceTruncate: calibrated prefix survival of a DSpark block and the verify lengths it implies.

Schema (the op every backend implements; this numpy function is its reference):

    inputs   logits        f32 [B, γ]   raw confidence-head logits, draft position k = 0..γ-1
             temperatures  f32 [γ]      STS temperature per position (the artifact's HeadSpec.temperatures)
             threshold     f32 []       cut each row where survival drops below it (used when budget < 0)
             budget        i64 []       total drafts to verify over the batch (>= 0), or -1 for threshold mode
    outputs  survival      f32 [B, γ]   a[b, k] = Π_{i<=k} sigmoid(logits[b, i] / temperatures[i])
             lengths       i64 [B]      drafts to verify per row

threshold mode: lengths[b] = #{k : a[b, k] >= threshold} (a is non-increasing along k, so that is a prefix).
budget mode:    the `budget` (b, k) pairs of largest survival over the whole batch (pairs with survival 0, which
                float32 sigmoids reach only for logits below -100, never), ties broken by the lower flat index
                b·γ + k; because a is non-increasing along k, the admitted pairs of each row form a prefix,
                and lengths[b] counts them.

Implementations: this reference (the schedulers use it); `truncate_torch` (the torch backend, on any device);
the same-named ONNX local function in the exported DSpark graph (`function_proto`, which ONNX Runtime runs:
survival as exp(cumsum(log sigmoid)), so it agrees with the reference to float32 rounding); and the TensorRT
plugin with its ahead-of-time OpenAI-Triton kernel (plugins/trt_confidence_truncate.py).

Nothing here looks at whether a draft will be accepted, only at the draft's own confidence, which is what keeps
speculative decoding exact under any schedule (DSpark paper, Appendix A).
"""
from __future__ import annotations

import numpy as np


def survival(logits: np.ndarray, temperatures: np.ndarray) -> np.ndarray:
    """a[b, k] = Π_{i<=k} sigmoid(logits[b, i] / T_i), in float32 like the kernels."""
    z = np.asarray(logits, np.float32) / np.asarray(temperatures, np.float32)
    return np.cumprod(1.0 / (1.0 + np.exp(-z)), axis=-1, dtype=np.float32).astype(np.float32)


def truncate(logits: np.ndarray, temperatures: np.ndarray, threshold: float = 0.0, budget: int = -1
             ) -> tuple[np.ndarray, np.ndarray]:
    """(survival [B, γ] f32, lengths [B] i64): the reference of specrt::ConfidenceTruncate."""
    a = survival(logits, temperatures)
    if budget < 0:
        return a, (a >= np.float32(threshold)).sum(axis=-1).astype(np.int64)
    return a, admit(a, budget)


def admit(a: np.ndarray, budget: int) -> np.ndarray:
    """Budget mode on survivals a [B, γ]: per row, how many of the `budget` best (b, k) pairs fall in it."""
    b, g = a.shape
    flat = a.ravel()
    taken = np.argsort(-flat, kind="stable")[:max(0, budget)]  # stable: ties by lower flat index
    return np.bincount(taken[flat[taken] > 0] // g, minlength=b).astype(np.int64)


def truncate_torch(logits, temperatures, threshold, budget):
    """The op on torch tensors of any device, with no host synchronisation (so a CUDA graph can capture it):
    logits f32 [B, γ], temperatures f32 [γ], threshold f32 [], budget i64 [] -> (survival, lengths i64 [B])."""
    import torch

    a = torch.cumprod(torch.sigmoid(logits.float() / temperatures), dim=-1)
    kept = (a >= threshold).sum(-1)
    flat = a.reshape(-1)
    order = torch.arange(flat.numel(), device=flat.device)
    # a pair's rank: the pairs with larger survival, or equal survival at a lower flat index
    better = (flat[None, :] > flat[:, None]) | ((flat[None, :] == flat[:, None]) & (order[None, :] < order[:, None]))
    admitted = ((better.sum(-1) < budget) & (flat > 0)).view(a.shape).sum(-1)
    return a, torch.where(budget < 0, kept, admitted)


DOMAIN, OP = "specrt", "ConfidenceTruncate"
INPUTS = ("logits", "temperatures", "threshold", "budget")
OUTPUTS = ("survival", "lengths")


def function_proto(opset: int) -> "onnx.FunctionProto":
    """specrt::ConfidenceTruncate as an ONNX local function (standard ops only), for ONNX Runtime.

    TensorRT's parser imports a model's local functions before plugins, so an engine build removes this
    function from the model first; the node then resolves to the registered plugin (plugin_namespace)."""
    import onnx
    from onnx import TensorProto, helper

    def const(name, value, dtype):
        return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, dtype, [len(value)], value))

    n = helper.make_node
    nodes = [
        const("axis1", [1], TensorProto.INT64), const("flat_shape", [-1], TensorProto.INT64),
        const("zero_f", [0.0], TensorProto.FLOAT), const("zero_i", [0], TensorProto.INT64),
        const("one_i", [1], TensorProto.INT64), const("last_axis", [-1], TensorProto.INT64),
        n("Div", ["logits", "temperatures"], ["z"]),
        n("Neg", ["z"], ["neg_z"]), n("Softplus", ["neg_z"], ["sp"]), n("Neg", ["sp"], ["log_sig"]),  # log σ(z)
        n("CumSum", ["log_sig", "axis1"], ["log_a"]), n("Exp", ["log_a"], ["survival"]),
        # threshold mode: the length of the prefix with survival >= threshold
        n("GreaterOrEqual", ["survival", "threshold"], ["kept"]), n("Cast", ["kept"], ["kept_i"], to=TensorProto.INT64),
        n("ReduceSum", ["kept_i", "axis1"], ["thr_len"], keepdims=0),
        # budget mode: rank every (b, k) pair (better: larger, or equal at a lower flat index), admit rank < budget
        n("Reshape", ["survival", "flat_shape"], ["flat"]), n("Shape", ["flat"], ["count"]),
        n("Squeeze", ["count"], ["count0"]), n("Squeeze", ["zero_i"], ["zero0"]), n("Squeeze", ["one_i"], ["one0"]),
        n("Range", ["zero0", "count0", "one0"], ["index"]),
        n("Unsqueeze", ["flat", "last_axis"], ["col"]), n("Unsqueeze", ["index", "last_axis"], ["index_col"]),
        n("Greater", ["flat", "col"], ["larger"]), n("Equal", ["flat", "col"], ["same"]),
        n("Less", ["index", "index_col"], ["before"]), n("And", ["same", "before"], ["tie_first"]),
        n("Or", ["larger", "tie_first"], ["better"]), n("Cast", ["better"], ["better_i"], to=TensorProto.INT64),
        n("ReduceSum", ["better_i", "last_axis"], ["rank"], keepdims=0),
        n("Less", ["rank", "budget"], ["in_budget"]), n("Greater", ["flat", "zero_f"], ["positive"]),
        n("And", ["in_budget", "positive"], ["admitted"]), n("Shape", ["survival"], ["shape"]),
        n("Reshape", ["admitted", "shape"], ["admitted2"]), n("Cast", ["admitted2"], ["adm_i"], to=TensorProto.INT64),
        n("ReduceSum", ["adm_i", "axis1"], ["budget_len"], keepdims=0),
        n("Less", ["budget", "zero_i"], ["use_threshold0"]), n("Squeeze", ["use_threshold0"], ["use_threshold"]),
        n("Where", ["use_threshold", "thr_len", "budget_len"], ["lengths"]),
    ]
    return helper.make_function(DOMAIN, OP, list(INPUTS), list(OUTPUTS), nodes,
                                [helper.make_opsetid("", opset)],
                                attributes=["plugin_namespace", "plugin_version"])
